"""Subscribe to one engine publisher's KV events (one per data-parallel rank), repair what is
lost, and feed the translator.

The engine numbers its batches ``seq`` = 0, 1, 2, ... per process (``protocols.native_kv``).
What the subscriber does with the number of each batch that arrives::

    expected   got              action
    ---------  ---------------  -------------------------------------------------------------
    none       0                apply (we joined at the engine's start)
    none       s > 0            late join: replay 0..s-1 from the engine's buffer (what it still
                                holds; blocks cached before that are never indexed), apply s
    n          n                apply
    n          s > n            gap: replay n..s-1, apply them and s; when the buffer no longer
                                reaches n (or no replay endpoint, or no answer in time), clear
                                the worker (AllBlocksCleared), apply what the buffer had, and s
    n          s < n            the engine restarted: clear, then as "none"

After a disconnection, a restarted engine may already number past ``n``, and its batches
must not be applied on the old process's blocks: the subscriber first asks the replay buffer
for batch ``n-1`` and compares it with the one it applied. Another payload, or none, means
another process (clear, then as "none"); without a replay endpoint a reconnection always
clears.

A replay is a DEALER connected to the engine's ROUTER for that one request (a late answer to an
abandoned request cannot reach the next one): send ``[b"", start]``, read ``[b"", seq, payload]``
until the end marker, within ``replay_timeout_s`` and at most ``max_replay_batches`` batches.
The live SUB socket queues meanwhile (``rcvhwm``).

A malformed frame or payload is counted, logged (once per kind, then once a minute) and
skipped; the loop never dies of its input. ``last_event_at`` is the time of the last frame
(engines publish only when their cache changes, so silence is also what an idle engine looks
like; the attach engine decides what a silent publisher means). ``stop`` closes the sockets
at once (linger 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from turnout.engines.attach.native_kv import LogGate, NativeKvTranslator
from turnout.protocols.kv import KvCacheEvent
from turnout.protocols.native_kv import (
    NativeKvDecodeError,
    decode_native_batch,
    read_seq,
    seq_bytes,
)

log = logging.getLogger(__name__)

EventsCallback = Callable[[list[KvCacheEvent]], None]


class SubscriberState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class SubscriberStats(msgspec.Struct, kw_only=True):
    """What one subscription saw, for metrics."""

    frames: int = 0
    batches: int = 0
    #: Connections to the publisher lost (ZeroMQ reconnects by itself).
    disconnects: int = 0
    gaps: int = 0
    #: Gaps repaired in full from the replay buffer.
    replays: int = 0
    #: Joins after the engine's first batch, whose earlier batches were asked for.
    late_joins: int = 0
    replayed_batches: int = 0
    replay_failures: int = 0
    resets: int = 0
    malformed_frames: int = 0
    unknown_events: int = 0
    rank_mismatches: int = 0


class NativeKvSubscriber:
    """The KV events of one engine publisher (``tcp://host:port``), translated for one rank.

    ``on_events`` gets each non-empty list of translated events, in order (the attach engine
    wraps them in a ``KvEventBatch`` for its sink); it is called on the event loop and must
    not block. ``replay_endpoint`` is the engine's replay socket (vLLM's ``replay_endpoint``,
    offset by the rank like the PUB port); without one, every gap clears the worker.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        translator: NativeKvTranslator,
        on_events: EventsCallback,
        dp_rank: int = 0,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = 5.0,
        max_replay_batches: int = 20_000,
        poll_interval_s: float = 1.0,
        rcvhwm: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if replay_timeout_s <= 0 or poll_interval_s <= 0:
            raise ValueError("replay_timeout_s and poll_interval_s must be positive")
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._translator = translator
        self._on_events = on_events
        self._dp_rank = dp_rank
        self._replay_timeout = replay_timeout_s
        self._max_replay = max_replay_batches
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._rcvhwm = rcvhwm
        self._clock = clock
        self._own_context = context is None
        self._context = context
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._state = SubscriberState.NEW
        #: Sequence number of the next batch; None: accept any (start, after a reset).
        self._expected: int | None = None
        self._disconnected = False
        #: The payload of batch ``_expected - 1``, to recognise its process after a reconnection.
        self._last_payload: bytes | None = None
        self._log = LogGate(log, clock=clock)
        self.stats = SubscriberStats()
        #: ``clock()`` when the last frame arrived; None before the first.
        self.last_event_at: float | None = None

    @property
    def state(self) -> SubscriberState:
        return self._state

    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    @property
    def endpoint(self) -> str:
        return self._endpoint

    async def start(self) -> None:
        """Connect (ZeroMQ keeps reconnecting while the engine is away) and start reading."""
        if self._state is not SubscriberState.NEW:
            raise RuntimeError(f"cannot start a subscriber in state {self._state.value}")
        if self._context is None:
            self._context = zmq.asyncio.Context()
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self._endpoint)
        self._sub = sub
        self._state = SubscriberState.RUNNING
        self._task = asyncio.create_task(self._run(), name=f"native-kv-{self._endpoint}")

    async def stop(self) -> None:
        """Stop reading and close the sockets now (nothing pending is waited for)."""
        if self._state is SubscriberState.STOPPED:
            return
        self._state = SubscriberState.STOPPED
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # a cancellation of stop() itself still propagates
            if not task.cancelled() and task.exception() is not None:
                log.error(
                    "native KV: the subscription had failed (%s)",
                    self._endpoint,
                    exc_info=task.exception(),
                )
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        if self._own_context and self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    # ---- the loop ------------------------------------------------------------------------------

    async def _run(self) -> None:
        sub, monitor = self._sub, self._monitor
        assert sub is not None and monitor is not None
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll(self._poll_ms))
            if monitor in ready:
                event = await recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self.stats.disconnects += 1
                    self._disconnected = True
            if sub in ready:
                frames = await sub.recv_multipart()
                try:
                    await self._on_frames(frames)
                except Exception:  # a bug on one frame's path must not end the subscription
                    log.exception("native KV: handling a frame failed (%s)", self._endpoint)

    async def _on_frames(self, frames: list[bytes]) -> None:
        self.stats.frames += 1
        self.last_event_at = self._clock()
        if len(frames) != 3:
            self._malformed(f"{len(frames)} frames, expected [topic, seq, payload]")
            return
        try:
            seq = read_seq(frames[1])
        except ValueError as exc:
            self._malformed(str(exc))
            return
        expected = self._expected
        if self._disconnected:
            self._disconnected = False
            if expected is not None and seq >= expected and not await self._same_process():
                self._reset("the publisher reconnected as another process (restarted)")
                expected = None
        if expected is not None and seq < expected:
            self._reset("the sequence went backwards (the engine restarted)")
            expected = None
        if expected is None:
            if seq > 0:
                await self._repair(0, seq, late_join=True)
        elif seq > expected:
            self.stats.gaps += 1
            await self._repair(expected, seq, late_join=False)
        self._apply(seq, frames[2])

    async def _repair(self, start: int, stop: int, *, late_join: bool) -> None:
        """Apply batches ``start .. stop-1`` from the replay buffer; clear the worker first
        when they cannot all be had (never on a late join: there is nothing to clear)."""
        got = await self._fetch_replay(start, stop) if self._replay_endpoint else None
        # The buffer holds consecutive batches; keep the run that ends just before ``stop``.
        run: list[tuple[int, bytes]] = []
        for seq, payload in reversed(got or []):
            if seq != stop - 1 - len(run):
                break
            run.append((seq, payload))
        run.reverse()
        complete = bool(run) and run[0][0] == start
        if late_join:
            self.stats.late_joins += 1
        elif complete:
            self.stats.replays += 1
        else:
            self.stats.replay_failures += 1
            self._reset(
                "events lost beyond the replay buffer"
                if got is not None
                else "events lost and not replayed"
            )
        for seq, payload in run:
            self.stats.replayed_batches += 1
            self._apply(seq, payload)

    async def _same_process(self) -> bool:
        """Whether the engine's replay buffer still holds the last batch applied, byte for
        byte (a restarted engine's batch of that number differs, if it has one at all)."""
        expected = self._expected
        if not self._replay_endpoint or expected is None or self._last_payload is None:
            return False
        got = await self._fetch_replay(expected - 1, expected)
        return got is not None and got[:1] == [(expected - 1, self._last_payload)]

    async def _fetch_replay(self, start: int, stop: int) -> list[tuple[int, bytes]] | None:
        """Ask the replay server for batches from ``start``; the batches below ``stop`` it
        answered with, in order, or None when it did not finish answering in time."""
        assert self._replay_endpoint is not None and self._context is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._replay_timeout
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self._replay_endpoint)
            await asyncio.wait_for(
                dealer.send_multipart([b"", seq_bytes(start)]), self._replay_timeout
            )
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await dealer.poll(int(remaining * 1000) + 1):
                    self._log.warning(
                        "replay_timeout",
                        "native KV: replay from %s got no end marker within %.1f s "
                        "(endpoint %s, dp_rank %s)",
                        start, self._replay_timeout, self._replay_endpoint, self._dp_rank,
                    )  # fmt: skip
                    return None
                frames = await dealer.recv_multipart()
                if frames and not frames[0]:
                    frames = frames[1:]  # the ROUTER's empty delimiter
                if len(frames) != 2:
                    self._malformed(f"replay answer of {len(frames)} frames")
                    return None
                seq = read_seq(frames[0])
                if seq < 0 or not frames[1]:
                    return out
                if start <= seq < stop and (not out or seq > out[-1][0]):
                    out.append((seq, frames[1]))
                    if len(out) > self._max_replay:
                        self._log.warning(
                            "replay_size",
                            "native KV: replay longer than %d batches: abandoned (endpoint "
                            "%s, dp_rank %s)",
                            self._max_replay, self._replay_endpoint, self._dp_rank,
                        )  # fmt: skip
                        return None
        except (TimeoutError, ValueError, zmq.ZMQError) as exc:
            self._log.warning(
                "replay_error",
                "native KV: replay failed: %s (endpoint %s, dp_rank %s)",
                exc, self._replay_endpoint, self._dp_rank,
            )  # fmt: skip
            return None
        finally:
            dealer.close(linger=0)

    # ---- effects -------------------------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes) -> None:
        """Translate and deliver batch ``seq`` (the next one in order)."""
        self._expected = seq + 1
        self._last_payload = payload
        try:
            batch = decode_native_batch(payload)
        except NativeKvDecodeError as exc:
            self._malformed(str(exc))
            return
        self.stats.batches += 1
        if batch.num_unknown:
            self.stats.unknown_events += batch.num_unknown
            self._log.warning(
                "unknown_event",
                "native KV: %d events of an unknown type skipped (endpoint %s, dp_rank %s)",
                batch.num_unknown, self._endpoint, self._dp_rank,
            )  # fmt: skip
        if batch.dp_rank is not None and batch.dp_rank != self._dp_rank:
            self.stats.rank_mismatches += 1
            self._log.warning(
                "rank",
                "native KV: batch stamped dp_rank %s on the endpoint of rank %s: indexed as "
                "%s (endpoint %s)",
                batch.dp_rank, self._dp_rank, self._dp_rank, self._endpoint,
            )  # fmt: skip
        self._emit(self._translator.translate(batch.events, self._dp_rank))

    def _reset(self, reason: str) -> None:
        self.stats.resets += 1
        self._expected = None
        self._last_payload = None
        self._log.warning(
            "reset",
            "native KV: %s: the worker's blocks are cleared (endpoint %s, dp_rank %s)",
            reason, self._endpoint, self._dp_rank,
        )  # fmt: skip
        self._emit(self._translator.clear(self._dp_rank))

    def _emit(self, events: list[KvCacheEvent]) -> None:
        if not events:
            return
        try:
            self._on_events(events)
        except Exception:  # the sink's trouble must not stop the subscription
            log.exception("native KV: delivering translated events failed (%s)", self._endpoint)

    def _malformed(self, what: str) -> None:
        self.stats.malformed_frames += 1
        self._log.warning(
            "malformed",
            "native KV: malformed frame skipped: %s (endpoint %s, dp_rank %s)",
            what, self._endpoint, self._dp_rank,
        )  # fmt: skip
