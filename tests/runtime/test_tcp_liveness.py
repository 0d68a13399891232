"""Liveness of the tcp request plane: keepalive, heartbeats on silent streams, both ends' idle
timeouts against a frozen peer, stream ids reused while live, and the bound on concurrent
streams."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

import pytest
from tests.polling import eventually

from turnout.errors import PeerUnavailable, StreamBroken
from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.request_plane import TcpClient, TcpServer
from turnout.runtime.request_plane.base import PeerState
from turnout.runtime.request_plane.framing import Frame, FrameReader, FrameWriter, Kind
from turnout.runtime.request_plane.tcp.client import _ClientConnection, split_address


async def slow(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    """Silent for ``payload`` seconds, then one item."""
    await asyncio.sleep(float(payload))
    yield b"done"


async def hang(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield b"first"
    await asyncio.get_running_loop().create_future()


async def serve(server: TcpServer) -> TransportAddress:
    server.register("slow", slow)
    server.register("hang", hang)
    return await server.start()


async def collect(
    client: TcpClient, address: TransportAddress, path: str, payload: bytes
) -> list[bytes]:
    stream = client.stream(address, path, payload, RequestContext("r"))
    try:
        return [item async for item in stream]
    finally:
        await stream.aclose()


async def test_heartbeats_keep_a_silent_stream_alive() -> None:
    server = TcpServer(heartbeat_interval=0.05)
    client = TcpClient(idle_timeout=0.3)
    try:
        address = await serve(server)
        # Silent for three idle timeouts: only the heartbeats say the peer is alive.
        assert await collect(client, address, "slow", b"0.9") == [b"done"]
    finally:
        await client.close()
        await server.stop()


async def test_a_silent_peer_breaks_the_stream() -> None:
    server = TcpServer(heartbeat_interval=0)  # a frozen process sends nothing either
    client = TcpClient(idle_timeout=0.2)
    try:
        address = await serve(server)
        with pytest.raises(StreamBroken, match=r"heard nothing for 0\.2s"):
            await collect(client, address, "hang", b"")
    finally:
        await client.close()
        await server.stop()


async def test_an_idle_connection_is_not_dropped() -> None:
    server = TcpServer(heartbeat_interval=0)
    client = TcpClient(idle_timeout=0.1)
    try:
        address = await serve(server)
        assert await collect(client, address, "slow", b"0") == [b"done"]
        conn = next(iter(client._conns.values()))
        await asyncio.sleep(0.4)  # no streams: silence is fine
        assert conn.is_open
        assert await collect(client, address, "slow", b"0") == [b"done"]
        assert next(iter(client._conns.values())) is conn
    finally:
        await client.close()
        await server.stop()


async def test_both_ends_turn_keepalive_on() -> None:
    server = TcpServer()
    client = TcpClient()
    try:
        address = await serve(server)
        assert await collect(client, address, "slow", b"0") == [b"done"]
        conns = [next(iter(client._conns.values())), next(iter(server._conns))]
        for conn in conns:
            assert conn.transport is not None
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_USER_TIMEOUT"):  # unacknowledged data is bounded too
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 25_000
    finally:
        await client.close()
        await server.stop()


async def test_streams_past_the_bound_are_refused() -> None:
    server = TcpServer(max_streams=1)
    client = TcpClient()
    try:
        address = await serve(server)
        first = client.stream(address, "hang", b"", RequestContext("a"))
        assert await first.__anext__() == b"first"
        with pytest.raises(PeerUnavailable, match="limit of 1 streams"):
            await collect(client, address, "slow", b"0")
        await first.aclose()
    finally:
        await client.close()
        await server.stop()


class RawPeer:
    """A hand-driven client on a real socket: sends exactly the frames a test gives it (a
    frozen frontend is one that stops sending)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._frames = FrameReader()
        self._pending: list[Frame] = []

    @classmethod
    async def connect(cls, address: TransportAddress) -> RawPeer:
        host, port = split_address(address.address)
        return cls(*await asyncio.open_connection(host, port))

    async def send(self, *frames: Frame) -> None:
        out = FrameWriter()
        for frame in frames:
            out.append(frame)
        self.writer.write(bytes(out.take()))
        await self.writer.drain()

    async def next_frame(self, timeout: float = 5.0) -> Frame | None:
        """The next frame other than a heartbeat; ``None`` once the server closed."""
        async with asyncio.timeout(timeout):
            while True:
                while self._pending:
                    frame = self._pending.pop(0)
                    if frame.kind != Kind.HEARTBEAT:
                        return frame
                data = await self.reader.read(65536)
                if not data:
                    return None
                self._pending.extend(self._frames.feed(data))

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def tracking_hang(cancelled: list[str]) -> Callable[[bytes, RequestContext], AsyncIterator[bytes]]:
    """A handler that yields once and then waits for ever, recording its request id when its
    context is cancelled."""

    async def handler(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        try:
            yield b"first"
            await asyncio.get_running_loop().create_future()
        finally:
            if ctx.is_cancelled:
                cancelled.append(ctx.request_id)

    return handler


async def test_the_server_drops_a_frozen_client_and_cancels_its_streams() -> None:
    """A client that sends a request and then nothing at all (no credit, no heartbeat: frozen)
    loses its connection after the server's idle timeout, and the handler is cancelled."""
    cancelled: list[str] = []
    server = TcpServer(heartbeat_interval=0.05, idle_timeout=0.3)
    server.register("track", tracking_hang(cancelled))
    address = await server.start()
    peer = await RawPeer.connect(address)
    try:
        await peer.send(Frame(Kind.REQUEST, 1, b"", "track", 0, "frozen"))
        first = await peer.next_frame()
        assert first is not None and first.kind == Kind.ACK
        data = await peer.next_frame()
        assert data is not None and data.kind == Kind.DATA
        # Frozen from here on: the server closes the connection (heartbeats do not count).
        assert await peer.next_frame(timeout=10.0) is None
        await eventually(lambda: cancelled == ["frozen"], what="the handler cancelled")
        assert not server._inflight
    finally:
        await peer.close()
        await server.stop()


async def test_client_heartbeats_keep_a_quiet_stream_alive_on_the_server() -> None:
    """A live client waiting on a handler that stays silent past the server's idle timeout
    keeps its stream: its heartbeats are what the server hears."""
    server = TcpServer(heartbeat_interval=0.05, idle_timeout=0.3)
    client = TcpClient(heartbeat_interval=0.05)
    try:
        address = await serve(server)
        assert await collect(client, address, "slow", b"1.0") == [b"done"]
    finally:
        await client.close()
        await server.stop()


async def test_a_live_stream_id_reused_is_refused_and_the_live_stream_goes_on() -> None:
    cancelled: list[str] = []
    server = TcpServer()
    server.register("track", tracking_hang(cancelled))
    address = await server.start()
    peer = await RawPeer.connect(address)
    try:
        await peer.send(Frame(Kind.REQUEST, 7, b"", "track", 0, "original"))
        kinds = [
            frame.kind for frame in [await peer.next_frame(), await peer.next_frame()] if frame
        ]
        assert kinds == [Kind.ACK, Kind.DATA]
        await peer.send(Frame(Kind.REQUEST, 7, b"", "track", 0, "impostor"))
        refused = await peer.next_frame()
        assert refused is not None and refused.kind == Kind.ERROR and refused.stream_id == 7
        assert "stream id 7 is already live" in refused.text
        # The original stream is the one still running: cancelling id 7 cancels it.
        conn = next(iter(server._conns))
        assert conn.streams[7].ctx.request_id == "original"
        await peer.send(Frame(Kind.CANCEL, 7))
        await eventually(lambda: cancelled == ["original"], what="the original cancelled")
        await eventually(lambda: not server._inflight, what="no stream left")
    finally:
        await peer.close()
        await server.stop()


async def test_a_silent_peer_is_reported_then_gone() -> None:
    """Peer listeners hear ``SILENT`` once the deadline passes (the stream still waits), then
    ``GONE`` when the idle timeout drops the connection and fails the stream."""
    server = TcpServer(heartbeat_interval=0)  # says nothing after its first item: frozen
    client = TcpClient(heartbeat_interval=0.05, silence_deadline=0.2, idle_timeout=0.8)
    heard: list[tuple[TransportAddress, PeerState]] = []
    client.add_peer_listener(lambda address, state: heard.append((address, state)))
    try:
        address = await serve(server)
        stream = client.stream(address, "hang", b"", RequestContext("r"))
        assert await anext(stream) == b"first"
        pending = asyncio.ensure_future(anext(stream))
        await eventually(lambda: heard == [(address, PeerState.SILENT)], what="SILENT")
        assert not pending.done()  # set aside, not failed: the idle timeout decides that
        with pytest.raises(StreamBroken, match="heard nothing"):
            async with asyncio.timeout(10):
                await pending
        assert heard == [(address, PeerState.SILENT), (address, PeerState.GONE)]
    finally:
        await client.close()
        await server.stop()


class _LostAsConnectEnds(TcpClient):
    """Its connections are lost the moment they are made: ``connection_lost`` is queued ahead
    of the callers resuming from the connect, as when the peer resets a fresh connection."""

    async def _connect(self, address: str) -> _ClientConnection:
        conn = await super()._connect(address)
        assert conn.transport is not None
        conn.transport.abort()
        return conn


async def test_a_connection_lost_before_the_request_is_sent_is_peer_unavailable() -> None:
    """The caller resumes from the connect on a connection already lost: its stream is
    PeerUnavailable at once, not a request dropped unsent and a stream nothing ever ends."""
    server = TcpServer()
    client = _LostAsConnectEnds(idle_timeout=0.2)
    try:
        address = await serve(server)
        with pytest.raises(PeerUnavailable, match="connection lost"):
            async with asyncio.timeout(3):
                await collect(client, address, "slow", b"0")
    finally:
        await client.close()
        await server.stop()


class _HeldConnect(TcpClient):
    """Its connects never finish: they wait until ``close()`` cancels them."""

    def __init__(self) -> None:
        super().__init__()
        self.connecting = asyncio.Event()

    async def _connect(self, address: str) -> _ClientConnection:
        self.connecting.set()
        await asyncio.get_running_loop().create_future()
        raise AssertionError("unreachable: the future is never resolved")


async def test_close_during_a_connect_is_peer_unavailable_for_its_callers() -> None:
    """``close()`` cancels the connects in flight: their callers get PeerUnavailable (the
    client is closed), not a bare CancelledError that reads as their own cancellation."""
    client = _HeldConnect()
    address = TransportAddress(kind="tcp", address="127.0.0.1:9")
    caller = asyncio.ensure_future(collect(client, address, "slow", b"0"))
    try:
        async with asyncio.timeout(3):
            await client.connecting.wait()
        await client.close()
        with pytest.raises(PeerUnavailable, match="closed"):
            async with asyncio.timeout(3):
                await caller
    finally:
        caller.cancel()
        await client.close()
