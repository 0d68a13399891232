"""A minimal HTTP/1.1 keep-alive load generator for the frontend benchmarks.

Why not httpx: on a 2-core machine the load generator competes with the process it measures,
and httpx spends several times the frontend's own CPU per request (h11 parsing, header
objects, its own async layers). This client does the least that is still correct for what
the frontend sends: one pre-rendered request, a status line, ``content-length`` or
``transfer-encoding: chunked`` bodies, keep-alive connections, each driven by an
``asyncio.Protocol`` (no stream reader layers).

It records, per request, the latency to the last body byte and to the first body chunk
(for SSE streams: time to first token as the client sees it).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

from turnout.runtime.progress import Bar, progress_bar


def render_post(host: str, path: str, body: bytes) -> bytes:
    """A complete POST request with a JSON body (sent as is for every request)."""
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


class _Conn(asyncio.Protocol):
    """One keep-alive connection; one request in flight at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.done: asyncio.Future[tuple[int, float, bytes]] | None = None
        self.lost: BaseException | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.body_start = -1  # index in buf where the body starts; -1: headers incomplete
        self.length = -1  # content-length, or -1 for chunked
        self.chunk_pos = 0  # chunked: where the next chunk-size line starts
        self.first_chunk_at = 0.0
        self.keep_body = False
        self.body_parts: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("connection closed by the server")
        if self.done is not None and not self.done.done():
            self.done.set_exception(self.lost)

    def request(self, raw: bytes, keep_body: bool) -> asyncio.Future[tuple[int, float, bytes]]:
        assert self.transport is not None
        if self.lost is not None:
            raise self.lost
        self.done = asyncio.get_running_loop().create_future()
        self.keep_body = keep_body
        self.transport.write(raw)
        return self.done

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if self.body_start < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            self.status = int(head[9:12])
            self.body_start = end + 4
            self.chunk_pos = self.body_start
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                self.length = int(head[i + 17 : j if j >= 0 else len(head)])
            elif b"\r\ntransfer-encoding: chunked" in head:
                self.length = -1
            else:
                raise RuntimeError(f"response without length: {head!r}")
        if self.length >= 0:
            if len(buf) - self.body_start >= self.length:
                body = bytes(buf[self.body_start : self.body_start + self.length])
                del buf[: self.body_start + self.length]
                self._complete(body)
            return
        # chunked: walk the complete chunks received so far
        pos = self.chunk_pos
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(buf[pos:eol].split(b";", 1)[0], 16)
            if size == 0:
                if len(buf) < eol + 4:  # "0\r\n" + "\r\n" (no trailers)
                    break
                del buf[: eol + 4]
                self._complete(b"".join(self.body_parts))
                return
            if len(buf) < eol + 2 + size + 2:
                break
            if not self.first_chunk_at:
                self.first_chunk_at = time.perf_counter()
            if self.keep_body:
                self.body_parts.append(bytes(buf[eol + 2 : eol + 2 + size]))
            pos = eol + 2 + size + 2
        self.chunk_pos = pos

    def _complete(self, body: bytes) -> None:
        done, status, first = self.done, self.status, self.first_chunk_at
        self._reset()
        if self.buf:
            raise RuntimeError("bytes after the end of a response")
        if done is not None and not done.done():
            done.set_result((status, first, body))


@dataclass
class LoadResult:
    elapsed_s: float
    latencies_s: list[float] = field(default_factory=list)
    first_chunk_s: list[float] = field(default_factory=list)
    errors: int = 0
    sample_body: bytes = b""


#: Requests between two updates of the progress bar.
PROGRESS_EVERY = 64


async def run_load(
    host: str, port: int, raw: bytes, total: int, concurrency: int, *, streamed: bool
) -> LoadResult:
    """Send ``raw`` ``total`` times over ``concurrency`` keep-alive connections."""
    loop = asyncio.get_running_loop()
    conns: list[_Conn] = []
    for _ in range(concurrency):
        _, conn = await loop.create_connection(_Conn, host, port)
        conns.append(conn)
    result = LoadResult(elapsed_s=0.0)
    remaining = total

    async def worker(conn: _Conn, bar: Bar) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            keep = not result.sample_body
            t0 = time.perf_counter()
            status, first, body = await conn.request(raw, keep)
            t1 = time.perf_counter()
            if keep:
                result.sample_body = body
            if status != 200:
                result.errors += 1
            latencies = result.latencies_s
            latencies.append(t1 - t0)
            if streamed and first:
                result.first_chunk_s.append(first - t0)
            if not len(latencies) % PROGRESS_EVERY:
                bar.update(len(latencies))

    started = time.perf_counter()
    try:
        # On a terminal only (rich, throttled): the client's CPU is part of what is measured.
        with progress_bar(f"{total} requests x{concurrency}", total) as bar:
            await asyncio.gather(*(worker(c, bar) for c in conns))
    finally:
        result.elapsed_s = time.perf_counter() - started
        for conn in conns:
            if conn.transport is not None:
                conn.transport.close()
    return result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _OneRequest(asyncio.Protocol):
    """One request on its own connection; resolves to (status, lower-cased head, raw body)
    once the response is complete (``content-length`` or chunked), or fails when the
    connection goes first."""

    def __init__(self, raw: bytes, done: asyncio.Future[tuple[int, bytes, bytes]]) -> None:
        self.raw = raw
        self.done = done
        self.buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.raw)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.done.done():
            return
        head = bytes(self.buf[:end]).lower()
        body = bytes(self.buf[end + 4 :])
        m = re.search(rb"\r\ncontent-length: *(\d+)", head)
        # content-length, or chunked, where the last chunk is "0\r\n\r\n"
        complete = len(body) >= int(m.group(1)) if m else body.endswith(b"0\r\n\r\n")
        if complete:
            self.done.set_result((int(head[9:12]), head, body))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError("closed before a complete response"))


async def one_request(
    host: str, port: int, raw: bytes, timeout: float
) -> tuple[int, bytes, bytes] | str:
    """One request on a connection of its own, within ``timeout`` seconds: (status, head,
    body), or a string naming what went wrong instead (for load tests that count outcomes)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[tuple[int, bytes, bytes]] = loop.create_future()
    transport = None
    try:
        async with asyncio.timeout(timeout):
            transport, _ = await loop.create_connection(lambda: _OneRequest(raw, done), host, port)
            return await done
    except (OSError, TimeoutError) as exc:
        return repr(exc)
    finally:
        if transport is not None:
            transport.close()
