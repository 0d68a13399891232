"""Fetch, verify and cache the artifacts model cards name (today: tokenizers), by content.

A card names its tokenizer with an ``ArtifactRef`` (name, kind, sha256, size); the bytes live
in the worker. The frontend gets them here, and nowhere else: no frontend code path opens a
file a card names. Where they come from, first hit wins:

1. the in-memory LRU of loaded tokenizers (keyed by sha256 and the card's bos/eos tokens):
   every instance, every LoRA and every model sharing a tokenizer shares one object;
2. the on-disk cache, content-addressed (``<root>/<sha[:2]>/<sha>``), written atomically
   (temporary file + rename) and verified again when read; root ``$TURNOUT_ARTIFACT_CACHE``,
   default ``~/.cache/turnout/artifacts``, disabled by ``TURNOUT_ARTIFACT_CACHE=off``;
3. the request plane: the ``artifact`` side handler of a live instance of the model's
   endpoint, the card's own instance first, then the others, in chunks, each attempt under
   the fetch's deadline. Bytes whose length or sha256 differ from the reference are refused.

Sizes: the card's announced ``size`` is a claim from whoever wrote the store, so an artifact
announced past ``max_bytes`` (``--max-artifact-bytes``) is refused before anything is asked
or read, and a fetch holds at most ``min(size, max_bytes)`` bytes: an instance that sends one
byte more is cut off mid-stream (its stream cancelled), never buffered.

A fetch that fails everywhere raises ``ArtifactError`` with every instance's reason; the model
watcher then leaves that instance's model unbuilt (all-or-nothing) and builds it when a later
instance's card arrives.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import re
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Protocol

import msgspec

from turnout.errors import ConfigError
from turnout.llm.artifacts import ArtifactError
from turnout.llm.tokenizer import Tokenizer, load_tokenizer
from turnout.protocols.card_bounds import DEFAULT_MAX_ARTIFACT_BYTES
from turnout.protocols.model import ARTIFACT_HANDLER, ArtifactRef, ArtifactRequest, EndpointId
from turnout.runtime.context import RequestContext
from turnout.runtime.progress import MIN_BYTES, Bar, progress_bar

log = logging.getLogger(__name__)

__all__ = [
    "CACHE_ENV",
    "DEFAULT_ATTEMPT_TIMEOUT",
    "DEFAULT_FETCH_TIMEOUT",
    "ArtifactFetcher",
    "ArtifactSource",
    "DiskArtifactCache",
]

#: Environment variable naming the on-disk cache's root ("off", "none" or "" disable it).
CACHE_ENV = "TURNOUT_ARTIFACT_CACHE"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
#: Seconds one artifact fetch may take, every instance and retry included.
DEFAULT_FETCH_TIMEOUT = 30.0
#: Seconds one instance may take to send it (an unresponsive one must leave time for others).
DEFAULT_ATTEMPT_TIMEOUT = 10.0
#: Rounds over the candidate instances before giving up (a worker registers its artifact
#: handler just after publishing its card, so an early first round can miss it).
DEFAULT_ROUNDS = 3
_RETRY_DELAY = 0.1
#: Loaded tokenizers kept in memory (each is a few MB of Rust state).
DEFAULT_MAX_TOKENIZERS = 32

_encode = msgspec.msgpack.Encoder().encode


class ArtifactSource(Protocol):
    """What fetching needs of an endpoint client (``runtime.endpoint_client.EndpointClient``)."""

    @property
    def endpoint(self) -> EndpointId: ...

    def announced_ids(self) -> set[int]: ...

    def call(
        self, instance_id: int, name: str, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]: ...


class DiskArtifactCache:
    """Artifacts on local disk, named by sha256; safe to share between frontend processes."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    @classmethod
    def from_env(cls) -> DiskArtifactCache | None:
        """The cache ``$TURNOUT_ARTIFACT_CACHE`` names (default ``~/.cache/turnout/artifacts``),
        or ``None`` when it is switched off."""
        return cls.from_setting(os.environ.get(CACHE_ENV))

    @classmethod
    def from_setting(cls, value: str | None) -> DiskArtifactCache | None:
        """The cache at ``value`` (``--artifact-cache``): a directory, ``off`` for none,
        ``None`` for the default ``~/.cache/turnout/artifacts``."""
        if value is None:
            return cls(Path.home() / ".cache" / "turnout" / "artifacts")
        if value.strip().lower() in ("", "off", "none", "0"):
            return None
        return cls(value)

    def path(self, sha256: str) -> Path:
        """Where ``sha256`` is kept; anything but 64 hex digits is refused (a checksum names a
        file here, so it must never be able to name one elsewhere)."""
        if not _SHA256_HEX.fullmatch(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256[:80]!r}")
        return self.root / sha256[:2] / sha256

    def get(self, ref: ArtifactRef) -> bytes | None:
        """The bytes of ``ref``, if cached and intact (a corrupt entry is deleted)."""
        path = self.path(ref.sha256)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("artifact cache: cannot read %s: %s", path, e)
            return None
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
            log.warning("artifact cache: %s is corrupt; removing it", path)
            path.unlink(missing_ok=True)
            return None
        return data

    def put(self, ref: ArtifactRef, data: bytes) -> None:
        """Store verified bytes: written to a temporary file, then renamed into place, so a
        reader never sees half a file. Failures are logged, never raised (it is a cache)."""
        path = self.path(ref.sha256)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{ref.sha256[:16]}.")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            log.warning("artifact cache: cannot write %s: %s", path, e)


class ArtifactFetcher:
    """Tokenizers for model cards, by content (see the module docstring).

    ``disk``: the on-disk cache; by default the one the environment names, ``None`` for none.
    ``timeout``: the deadline of one artifact fetch; ``attempt_timeout``: of asking one
    instance once. ``max_bytes``: the largest artifact taken (``--max-artifact-bytes``).
    ``fetches`` counts fetch attempts over the request plane (a cache hit costs none).
    """

    def __init__(
        self,
        *,
        disk: DiskArtifactCache | str | None = "env",
        timeout: float = DEFAULT_FETCH_TIMEOUT,
        attempt_timeout: float = DEFAULT_ATTEMPT_TIMEOUT,
        rounds: int = DEFAULT_ROUNDS,
        max_tokenizers: int = DEFAULT_MAX_TOKENIZERS,
        max_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES,
    ) -> None:
        if max_bytes < 1:
            raise ConfigError(f"--max-artifact-bytes must be at least 1, got {max_bytes}")
        if isinstance(disk, str):
            if disk != "env":
                raise ValueError(f"disk must be a DiskArtifactCache, None or 'env', not {disk!r}")
            disk = DiskArtifactCache.from_env()
        self.disk: DiskArtifactCache | None = disk
        self.timeout = timeout
        self.attempt_timeout = attempt_timeout
        self.rounds = max(rounds, 1)
        self.max_tokenizers = max(max_tokenizers, 1)
        self.max_bytes = max_bytes
        self.fetches = 0
        self._tokenizers: collections.OrderedDict[tuple[str, str | None, str | None], Tokenizer]
        self._tokenizers = collections.OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}

    async def tokenizer(
        self,
        ref: ArtifactRef,
        source: ArtifactSource,
        *,
        prefer: int | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> Tokenizer:
        """The tokenizer ``ref`` names, loaded once per distinct content (and bos/eos).

        ``prefer``: the instance to ask first (the card's own). Raises ``ArtifactError`` when
        no instance delivers bytes that match ``ref`` before the deadline.
        """
        key = (ref.sha256, bos_token, eos_token)
        tok = self._cached(key)
        if tok is not None:
            return tok
        lock = self._locks.setdefault(ref.sha256, asyncio.Lock())
        try:
            async with lock:  # one fetch per content, however many cards ask at once
                tok = self._cached(key)
                if tok is not None:
                    return tok
                data = await self.get_bytes(ref, source, prefer=prefer)
                try:
                    tok = await asyncio.to_thread(
                        load_tokenizer, ref, data, bos_token=bos_token, eos_token=eos_token
                    )
                except Exception as e:
                    raise ArtifactError(f"cannot load tokenizer {ref.sha256[:12]}: {e}") from e
                self._tokenizers[key] = tok
                while len(self._tokenizers) > self.max_tokenizers:
                    self._tokenizers.popitem(last=False)
                return tok
        finally:
            if not lock.locked() and self._locks.get(ref.sha256) is lock:
                del self._locks[ref.sha256]

    def _cached(self, key: tuple[str, str | None, str | None]) -> Tokenizer | None:
        tok = self._tokenizers.get(key)
        if tok is not None:
            self._tokenizers.move_to_end(key)
        return tok

    async def get_bytes(
        self, ref: ArtifactRef, source: ArtifactSource, *, prefer: int | None = None
    ) -> bytes:
        """The verified bytes of ``ref``: from the disk cache, else fetched (then cached).
        ``ArtifactError`` at once for an artifact announced past ``max_bytes``."""
        if ref.size > self.max_bytes:
            raise ArtifactError(
                f"artifact {ref.name} (sha256 {ref.sha256[:12]}...) is announced at {ref.size} "
                f"bytes; this frontend takes at most {self.max_bytes} (--max-artifact-bytes)"
            )
        if self.disk is not None:
            data = await asyncio.to_thread(self.disk.get, ref)
            if data is not None:
                return data
        data = await self._fetch(ref, source, prefer)
        if self.disk is not None:
            await asyncio.to_thread(self.disk.put, ref, data)
        return data

    async def _fetch(self, ref: ArtifactRef, source: ArtifactSource, prefer: int | None) -> bytes:
        """Ask the candidates in turn, for ``rounds`` rounds, all within ``timeout``."""
        errors: dict[int, str] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        for round_no in range(self.rounds):
            candidates = [prefer] if prefer is not None else []
            # Every announced instance, accepted for routing or not: content is verified.
            candidates += sorted(i for i in source.announced_ids() if i != prefer)
            for instance_id in candidates:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    data = await self._fetch_from(
                        ref, source, instance_id, min(left, self.attempt_timeout)
                    )
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    reason = "timed out" if isinstance(e, TimeoutError) else str(e)
                    errors[instance_id] = reason or type(e).__name__
                    log.debug(
                        "artifact %s (%s) from instance %x failed: %s",
                        ref.name,
                        ref.sha256[:12],
                        instance_id,
                        errors[instance_id],
                    )
                    continue
                if errors:
                    log.warning(
                        "artifact %s (%s) fetched from instance %x after failures: %s",
                        ref.name,
                        ref.sha256[:12],
                        instance_id,
                        _describe(errors),
                    )
                return data
            if loop.time() >= deadline or round_no == self.rounds - 1:
                break
            await asyncio.sleep(min(_RETRY_DELAY * 2**round_no, max(deadline - loop.time(), 0)))
        raise ArtifactError(
            f"cannot fetch artifact {ref.name} (sha256 {ref.sha256[:12]}..., {ref.size} bytes) "
            f"from {source.endpoint.path()}: "
            + (_describe(errors) if errors else "no live instance to ask")
        )

    async def _fetch_from(
        self, ref: ArtifactRef, source: ArtifactSource, instance_id: int, timeout: float
    ) -> bytes:
        self.fetches += 1
        ctx = RequestContext()
        payload = _encode(ArtifactRequest(sha256=ref.sha256))
        chunks: list[bytes] = []
        received = 0
        # Checked as each chunk arrives, before it is kept: the bound on what is held.
        limit = min(ref.size, self.max_bytes)
        stream = source.call(instance_id, ARTIFACT_HANDLER, payload, ctx)
        shown = progress_bar(f"fetching {ref.name}", ref.size, unit="bytes")
        try:
            async with asyncio.timeout(timeout):
                with shown if ref.size >= MIN_BYTES else contextlib.nullcontext(Bar()) as bar:
                    async for chunk in stream:
                        received += len(chunk)
                        if received > limit:
                            raise ArtifactError(
                                f"sent more than the {ref.size} bytes announced"
                                if limit == ref.size
                                else f"sent more than {self.max_bytes} bytes (--max-artifact-bytes)"
                            )
                        chunks.append(chunk)
                        bar.update(received)
        finally:
            ctx.cancel()
            if isinstance(stream, AsyncGenerator):  # stop the call now, not when collected
                await stream.aclose()
        data = b"".join(chunks)
        if len(data) != ref.size:
            raise ArtifactError(f"sent {len(data)} bytes, the card announces {ref.size}")
        digest = await asyncio.to_thread(_sha256, data)
        if digest != ref.sha256:
            raise ArtifactError(f"checksum mismatch: got sha256 {digest[:12]}...")
        return data


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _describe(errors: dict[int, str]) -> str:
    return "; ".join(f"instance {iid:x}: {reason}" for iid, reason in errors.items())
