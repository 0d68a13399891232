"""Which CurveZMQ subscribers a publisher lets in: ZAP answered from the store's attested keys.

Mental model::

    subscribing plane ──put (under its lease)──▶ store: v1/plane_keys/{plane id:x}
                                                        (JSON Attestation of its Curve key)
    publishing plane ──watch v1/plane_keys/──▶ verified keys (AllowedKeys)
    subscriber ──CURVE handshake──▶ PUB socket ──ZAP request (inproc)──▶ SubscriberGate
                                    200: in; 300: out, it retries

A CURVE server socket asks its context's ZAP handler (``inproc://zeromq.zap.01``) about every
client key before the connection carries a message. The gate answers from the keys of the
attestations it has verified (``curve.AttestationVerifier``). A subscriber registers its key
before it connects, but the publisher's watch may not have it yet: the gate then holds the
answer up to ``AUTH_GRACE`` seconds for the key to arrive. Past that it answers 300 (a
temporary failure: libzmq closes the connection without telling the client, which reconnects
after the server's handshake timeout, ``HANDSHAKE_IVL_MS``), so a subscriber whose record is
late gets in on a later try; 400 would end its connection for good. A refused peer is logged
(``refusal_log.RefusalLog``: rate-limited per host) and counted.

Bounds: ``MAX_PLANE_KEYS`` distinct Curve keys are followed (past it records of further keys
are ignored, with a warning), each through at most ``MAX_RECORDS_PER_KEY`` records: copies of
one valid attestation under many store keys (anyone who writes to the store can copy one; it is
of no use without the Curve secret key) take one key's slot, and copies past that are ignored.
A key stays allowed while any followed record names it. ``MAX_PENDING_ZAP`` answers are held at
once (past it a request is answered 300 at once).

Every CURVE server socket sets ``ZAP_DOMAIN`` and ``ZAP_ENFORCE_DOMAIN`` (``require_zap``):
libzmq lets every CURVE client in when no ZAP handler is bound (the Stonehouse pattern) unless
the socket enforces its domain, so a gate that is not running refuses every subscriber rather
than admitting them all.
An admitted connection stays up when its key's record goes away later: keys are checked at
the handshake only.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq
import zmq.asyncio
from zmq.utils import z85

from turnout.runtime.discovery.base import DiscoveryStore, WatchEventKind
from turnout.runtime.event_plane.curve import Attestation, AttestationVerifier, decode_attestation
from turnout.runtime.lease import Lease
from turnout.runtime.refusal_log import RefusalLog

logger = logging.getLogger(__name__)

#: Root of the subscribers' key records in the discovery store (a wire format: keep it stable).
PLANE_KEYS_ROOT = "v1/plane_keys/"
#: Distinct Curve keys a publishing plane follows key records of.
MAX_PLANE_KEYS = 10_000
#: Key records naming one Curve key that a publishing plane follows (copies past it: ignored).
MAX_RECORDS_PER_KEY = 4
#: Seconds a ZAP answer waits for an unknown key's record to arrive.
AUTH_GRACE = 2.0
#: Milliseconds a CURVE server gives a handshake, ZAP answer included.
HANDSHAKE_IVL_MS = 5_000
#: ZAP answers held at once (waiting for a key).
MAX_PENDING_ZAP = 256

#: The ZAP domain of CURVE server sockets (in every ZAP request; the gate answers them all).
ZAP_DOMAIN = b"turnout.event_plane"

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"


def require_zap(sock: zmq.asyncio.Socket) -> None:
    """Make CURVE server ``sock`` refuse every client when no ZAP handler is bound (libzmq's
    default admits them all; see the module docstring)."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def plane_key_record(plane_id: int) -> str:
    return f"{PLANE_KEYS_ROOT}{plane_id:x}"


class KeyRegistration:
    """This plane's attestation at ``plane_key_record(plane_id)``, kept under its own lease and
    written again under a new one whenever the lease is lost."""

    def __init__(
        self, store: DiscoveryStore, plane_id: int, attestation: Attestation, ttl: float
    ) -> None:
        self._store = store
        self.key = plane_key_record(plane_id)
        self._value = msgspec.json.encode(attestation)
        self._ttl = ttl
        self._lease: Lease | None = None
        self._guard: asyncio.Task[None] | None = None
        #: Held by the first ``start`` while it writes: concurrent callers wait for it.
        self._starting = asyncio.Lock()

    async def start(self) -> None:
        """Write the record (once registered, later calls return at once)."""
        async with self._starting:
            if self._guard is not None:
                return
            await self._register()
            self._guard = asyncio.get_running_loop().create_task(
                self._keep_registered(), name=f"plane-key-{self.key}"
            )

    async def _register(self) -> None:
        lease = await Lease.grant(self._store, self._ttl)
        try:
            await self._store.put(self.key, self._value, lease_id=lease.id)
        except BaseException:
            await lease.revoke()
            raise
        self._lease = lease

    async def _keep_registered(self) -> None:
        delay = 0.1
        failures = 0
        while True:
            assert self._lease is not None
            await self._lease.lost.wait()
            if failures == 0:
                logger.warning("plane key record %s lost its lease; registering it again", self.key)
            try:
                await self._register()
                delay, failures = 0.1, 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # The first failure says why; the retries until it works say nothing new.
                failures += 1
                logger.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "plane key record %s: registering failed, retrying: %s",
                    self.key,
                    exc,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._ttl)

    async def close(self) -> None:
        """Withdraw the record (its lease revoked)."""
        if self._guard is not None:
            self._guard.cancel()
            await asyncio.wait([self._guard])
            self._guard = None
        if self._lease is not None:
            await self._lease.revoke()
            self._lease = None


class SubscriberGate:
    """The ZAP handler of one ZeroMQ context, answering from the verified keys in the store.

    Two tasks: the watch (follows ``PLANE_KEYS_ROOT``, verifying each record) and the ZAP
    reader; one more task per answer held for an unknown key (at most ``MAX_PENDING_ZAP``).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        store: DiscoveryStore,
        verifier: AttestationVerifier,
        *,
        grace: float = AUTH_GRACE,
    ) -> None:
        self._ctx = ctx
        self._store = store
        self._verifier = verifier
        self.grace = grace
        #: Record key -> its verified Curve key (Z85); the watch task alone changes it.
        self._records: dict[str, bytes] = {}
        #: Curve key (Z85) -> records naming it.
        self._allowed: dict[bytes, int] = {}
        #: Set (and replaced) whenever a key is allowed: held answers look again.
        self._added = asyncio.Event()
        self._pending: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._sock: zmq.asyncio.Socket | None = None
        #: Refused subscribers and key records: counted, and logged rate-limited.
        self.refusals = RefusalLog("zmq event plane", logger)

    @property
    def num_allowed(self) -> int:
        """Distinct Curve keys that may subscribe."""
        return len(self._allowed)

    def start(self) -> None:
        """Bind the context's ZAP endpoint and start following the store (once)."""
        if self._sock is not None:
            return
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(_ZAP_ENDPOINT)
        self._sock = sock
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._watch(), name="plane-keys-watch"),
            loop.create_task(self._serve(), name="plane-keys-zap"),
        ]

    async def close(self) -> None:
        tasks = self._tasks + list(self._pending)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=0)

    # -- following the store ------------------------------------------------------------------

    async def _watch(self) -> None:
        revision: int | None = None
        while True:
            events = self._store.watch_prefix(PLANE_KEYS_ROOT, start_revision=revision)
            try:
                async for event in events:
                    revision = event.kv.revision
                    if event.kind is WatchEventKind.PUT:
                        self._on_put(event.kv.key, event.kv.value)
                    else:
                        self._forget(event.kv.key)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("plane keys watch failed, resuming after %s: %s", revision, exc)
                await asyncio.sleep(1.0)
            finally:
                await events.aclose()

    def _on_put(self, key: str, value: bytes) -> None:
        self._forget(key)
        record = f"plane key record {key!r}"  # the store's writers pick the key: quoted
        try:
            attestation = decode_attestation(value)
        except msgspec.DecodeError as exc:
            self.refusals.refused("store", record, f"malformed: {exc}")
            return
        why = self._verifier.check(attestation)
        if why is not None:
            self.refusals.refused("store", record, why)
            return
        curve_key = attestation.curve_key.encode()
        held = self._allowed.get(curve_key, 0)
        if not held and len(self._allowed) >= MAX_PLANE_KEYS:
            self.refusals.refused("store", record, f"past {MAX_PLANE_KEYS} keys")
            return
        if held >= MAX_RECORDS_PER_KEY:
            self.refusals.refused("store", record, f"past {MAX_RECORDS_PER_KEY} records of its key")
            return
        self._records[key] = curve_key
        self._allowed[curve_key] = held + 1
        if not held:
            added, self._added = self._added, asyncio.Event()
            added.set()

    def _forget(self, key: str) -> None:
        curve_key = self._records.pop(key, None)
        if curve_key is None:
            return
        left = self._allowed[curve_key] - 1
        if left:
            self._allowed[curve_key] = left
        else:
            del self._allowed[curve_key]

    # -- answering ZAP --------------------------------------------------------------------------

    async def _serve(self) -> None:
        """Read ZAP requests (from libzmq, in this process): ``[routing id, "", "1.0", request
        id, domain, address, identity, mechanism, credentials...]``."""
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) < 8:
                logger.debug("ignoring a malformed ZAP request of %d frames", len(frames))
                continue
            mechanism, credentials = frames[7], frames[8:]
            if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
                await self._answer(frames, False, f"mechanism {mechanism!r}")
                continue
            key = z85.encode(credentials[0])
            if key in self._allowed:
                await self._answer(frames, True)
            elif len(self._pending) >= MAX_PENDING_ZAP:
                await self._answer(frames, False, "busy (too many ZAP answers held)", key)
            else:
                task = asyncio.get_running_loop().create_task(self._hold(frames, key))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)

    async def _hold(self, frames: list[bytes], key: bytes) -> None:
        """Answer once ``key`` is allowed, or refuse after the grace period."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace
        while key not in self._allowed:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                async with asyncio.timeout(remaining):
                    await self._added.wait()
            except TimeoutError:
                break
        allowed = key in self._allowed
        await self._answer(frames, allowed, "the key has no verified record", key)

    async def _answer(
        self, frames: list[bytes], allowed: bool, reason: str = "", key: bytes | None = None
    ) -> None:
        """Answer the ZAP request ``frames``; a refusal is logged and counted for ``reason``,
        with the client's Curve ``key`` where it has one."""
        assert self._sock is not None
        if not allowed:
            host = frames[5].decode(errors="replace")
            peer = f"subscriber {host}" + (f" (Curve key {key.decode()})" if key else "")
            self.refusals.refused(host, peer, reason)
        status = (b"200", b"OK") if allowed else (b"300", b"not allowed")
        await self._sock.send_multipart([frames[0], b"", b"1.0", frames[3], *status, b"", b""])
