"""One attached server's life: registered while it answers, set aside while it does not.

Lifecycle (every transition in ``_set``)::

    NEW ──▶ WAITING ──(answers, description read, tokenizer agrees)──▶ SERVING
              ▲  │                                                       │
              │  └──(answers wrongly: garbage, other tokenizer)──▶ SET_ASIDE
              │                                                          │
              └──────(health check fails / stream broke and probe fails)─┘
    any ──stop()──▶ STOPPED

SERVING means one instance in discovery: a ``Worker`` around an ``AttachedEngine`` in
tokens mode, a ``TextInstance`` in text mode, each with its own lease (a new instance id
each time the server comes back). When the engine reports that the server stopped
answering, the worker fails the streams in flight as ``engine_failed`` (the frontend
migrates them) and revokes the lease at once; the supervisor then probes the server every
``retry_interval`` seconds and registers it again, tokenizer re-checked, once it answers.
A server that answers but is refused (a different tokenizer, an answer that is not its API)
stays set aside with one error line, and is probed again at the same pace (it may be
restarted with the right model).

At process start (``first_start``), what cannot be a passing outage is fatal: a server that
answers garbage, a tokenizer mismatch, a card frontends would refuse: ``ConfigError``, and
``turnout attach`` exits with status 2 and that one line. A server that does not answer
yet is waited for (logged once, then every minute).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from turnout.errors import ConfigError
from turnout.protocols.model import EndpointId, ModelDeploymentCard, mdc_key
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.event_plane import EventPublisher
from turnout.runtime.serving import ServingInstance

from ..events import EventPlaneSink
from ..worker import FAILURE_DRAIN_SECONDS, Worker
from .cards import TokenizerSource, check_tokenizer, resolve_block_size, text_card, tokens_card
from .detect import TOKENS_APIS, detect_api, make_api
from .kv_events import KvEventsFeed
from .text_relay import relay_handler
from .tokens_engine import AttachedEngine
from .upstream import Deadlines, Unreachable, Upstream, UpstreamError, UpstreamTimeout

log = logging.getLogger("turnout.attach")

__all__ = ["AttachSettings", "AttachedServer", "ServerState"]

#: Seconds between two "still not answering" lines of one server.
_WAITING_LOG_EVERY = 60.0


class ServerState(enum.Enum):
    NEW = "new"
    WAITING = "waiting"
    SERVING = "serving"
    SET_ASIDE = "set_aside"
    STOPPED = "stopped"


_MOVES = {
    ServerState.NEW: {ServerState.WAITING, ServerState.SERVING, ServerState.SET_ASIDE},
    ServerState.WAITING: {ServerState.SERVING, ServerState.SET_ASIDE, ServerState.WAITING},
    ServerState.SET_ASIDE: {ServerState.SERVING, ServerState.WAITING, ServerState.SET_ASIDE},
    ServerState.SERVING: {ServerState.WAITING},
    ServerState.STOPPED: set(),
}


@dataclass(slots=True)
class AttachSettings:
    """What ``turnout attach`` was told, for every server it fronts."""

    endpoint: EndpointId
    api: str | None = None
    model_name: str | None = None
    block_size: int | None = None
    deadlines: Deadlines = field(default_factory=Deadlines)
    pool_size: int = 64
    max_waiting: int = 256
    health_interval: float = 2.0
    load_interval: float = 1.0
    retry_interval: float = 2.0
    drain_timeout: float = 5.0
    migration_limit: int | None = None
    device_type: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


class _Instance(Protocol):
    """What SERVING holds: something with ``failed``, ``failure`` and ``stop``."""

    @property
    def failed(self) -> asyncio.Event: ...

    @property
    def failure(self) -> str | None: ...

    async def stop(self, drain_timeout: float) -> None: ...


class TextInstance:
    """A text-mode server in discovery: the relay handler under its own lease, with the
    engine's health checks and load reports (its ``generate`` is never called)."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        engine: AttachedEngine,
        endpoint: EndpointId,
        card: ModelDeploymentCard,
    ) -> None:
        self.runtime = runtime
        self.engine = engine
        self.endpoint = endpoint
        self.card = card
        self.failed = asyncio.Event()
        self.failure: str | None = None
        self.serving: ServingInstance | None = None
        self._publisher: EventPublisher | None = None
        self._leaving: asyncio.Task[None] | None = None

    async def start(self) -> None:
        publisher = await self.runtime.event_plane.publisher(
            self.endpoint.namespace, self.endpoint.component
        )
        self._publisher = publisher
        self.engine.set_event_sink(EventPlaneSink(publisher))
        await self.engine.start()
        handler = relay_handler(self.engine.upstream, self.engine.served_name,
                                on_broken=self.engine.check_soon)  # fmt: skip

        def records(instance_id: int) -> list[tuple[str, bytes]]:
            self.engine.bind_instance(instance_id)
            card = msgspec.structs.replace(self.card, endpoint=self.endpoint,
                                           instance_id=instance_id)  # fmt: skip
            return [(mdc_key(self.endpoint, instance_id), msgspec.json.encode(card))]

        self.serving = await self.runtime.endpoint(self.endpoint).serve(handler, records=records)
        self.engine.on_failure(self._on_failure)

    def _on_failure(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        self._leaving = asyncio.get_running_loop().create_task(self._leave())

    async def _leave(self) -> None:
        try:
            if self.serving is not None:
                await self.serving.stop(FAILURE_DRAIN_SECONDS)
        finally:
            self.failed.set()

    async def stop(self, drain_timeout: float) -> None:
        if self._leaving is not None:
            await asyncio.wait([self._leaving])
        if self.serving is not None:
            await self.serving.stop(drain_timeout)
        await self.engine.stop()
        if self._publisher is not None:
            await self._publisher.close()
            self._publisher = None


class _WorkerInstance:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.failed = worker.failed

    @property
    def failure(self) -> str | None:
        return self.worker.failure

    async def stop(self, drain_timeout: float) -> None:
        await self.worker.stop(drain_timeout)


class AttachedServer:
    """One ``--url``: probes it, registers it, sets it aside and brings it back (see the
    module doc). ``kv_endpoints`` / ``kv_replays``: its native KV publishers (one per
    data-parallel rank), if any."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        url: str,
        settings: AttachSettings,
        tokenizers: TokenizerSource,
        *,
        kv_endpoints: list[str] | None = None,
        kv_replays: list[str | None] | None = None,
    ) -> None:
        self.runtime = runtime
        self.url = url.rstrip("/")
        self.settings = settings
        self.tokenizers = tokenizers
        self.kv_endpoints = kv_endpoints or []
        self.kv_replays = kv_replays or [None] * len(self.kv_endpoints)
        self.state = ServerState.NEW
        #: Why the server is not serving (None while it is).
        self.reason: str | None = None
        self.api_name: str | None = settings.api
        self.instance: _Instance | None = None
        #: Registrations so far (the first, and each return).
        self.registrations = 0
        self._last_waiting_log = -_WAITING_LOG_EVERY
        self._last_refusal: str | None = None
        self.changed = asyncio.Event()

    def _set(self, state: ServerState, reason: str | None = None) -> None:
        if state not in _MOVES[self.state]:
            raise RuntimeError(f"{self.url}: cannot go from {self.state.value} to {state.value}")
        self.state = state
        self.reason = reason
        self.changed.set()

    @property
    def instance_id(self) -> int | None:
        instance = self.instance
        if isinstance(instance, _WorkerInstance) and instance.worker.serving is not None:
            return instance.worker.serving.instance_id
        if isinstance(instance, TextInstance) and instance.serving is not None:
            return instance.serving.instance_id
        return None

    # ------------------------------------------------------------ bringing it up

    async def first_start(self) -> None:
        """One attempt at start-up: registered, or waiting for a server that does not
        answer; ``ConfigError`` for anything that waiting cannot fix."""
        try:
            await self._bring_up()
        except (Unreachable, UpstreamTimeout) as exc:
            self._waiting(exc)
        except UpstreamError as exc:
            raise ConfigError(f"{self.url} cannot be attached: {exc.detail}") from None

    async def _bring_up(self) -> None:
        settings = self.settings
        probe = Upstream(self.url, settings.deadlines, pool_size=2)
        await probe.open()
        try:
            name = self.api_name or await detect_api(probe)
            if self.api_name is None:
                log.info("%s: speaks the %s API", self.url, name)
                self.api_name = name
            tokens = name in TOKENS_APIS
            api = make_api(name, self.url)
            info = await api.describe(probe)
            served = info.served_name
            display = settings.model_name or served
            if tokens:
                loaded = await self.tokenizers.load(info, self.url)
                await check_tokenizer(api, probe, loaded)
                api = make_api(name, self.url, loaded.vocab)
                block = resolve_block_size(info, settings.block_size, self.url)
                kv = None
                if self.kv_endpoints:
                    kv = KvEventsFeed(self.kv_endpoints, self.kv_replays, block_size=block)
                card = tokens_card(loaded, info, api, name=display, block_size=block,
                                   kv_events=kv is not None,
                                   dp_size=max(1, len(self.kv_endpoints)))  # fmt: skip
            else:
                kv = None
                card = text_card(info, name=display, endpoint=settings.endpoint)
        finally:
            await probe.close()
        engine = AttachedEngine(
            url=self.url, api=api, card=card, served_name=served,
            deadlines=settings.deadlines, pool_size=settings.pool_size,
            max_waiting=settings.max_waiting, health_interval=settings.health_interval,
            load_interval=settings.load_interval, kv=kv,
        )  # fmt: skip
        instance: _Instance
        if tokens:
            worker = Worker(
                self.runtime, engine, settings.endpoint,
                migration_limit=settings.migration_limit, device_type=settings.device_type,
                tool_call_parser=settings.tool_call_parser,
                reasoning_parser=settings.reasoning_parser,
                health_interval=0,  # the engine checks the server itself
            )  # fmt: skip
            instance = _WorkerInstance(worker)
            try:
                await worker.start()
            except BaseException:
                await worker.stop(0)
                raise
        else:
            text = TextInstance(self.runtime, engine, settings.endpoint, card)
            instance = text
            try:
                await text.start()
            except BaseException:
                await text.stop(0)
                raise
        self.instance = instance
        self.registrations += 1
        self._last_refusal = None
        self._set(ServerState.SERVING)
        log.info("%s: attached as instance %x of model %r (%s, %s mode)", self.url,
                 self.instance_id or 0, display, name,
                 "tokens" if tokens else "text")  # fmt: skip

    def _waiting(self, exc: UpstreamError) -> None:
        self._set(ServerState.WAITING, str(exc))
        now = time.monotonic()
        if now - self._last_waiting_log >= _WAITING_LOG_EVERY:
            self._last_waiting_log = now
            log.warning("%s does not answer (%s); waiting for it (retry every %g s)",
                        self.url, exc.detail, self.settings.retry_interval)  # fmt: skip

    def _refused(self, message: str) -> None:
        self._set(ServerState.SET_ASIDE, message)
        if message != self._last_refusal:
            self._last_refusal = message
            log.error("%s is set aside: %s", self.url, message)

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Until cancelled: keep the server registered while it answers, bring it back when
        it does again."""
        while True:
            instance = self.instance
            if instance is not None:
                await instance.failed.wait()
                reason = instance.failure or "the server failed"
                log.warning("%s: set aside, its instance left discovery (%s)", self.url, reason)
                self.instance = None
                await instance.stop(0.0)
                self._last_waiting_log = time.monotonic()  # the warning above said it
                self._set(ServerState.WAITING, reason)
                continue
            await asyncio.sleep(self.settings.retry_interval)
            try:
                await self._bring_up()
            except (Unreachable, UpstreamTimeout) as exc:
                self._waiting(exc)
            except UpstreamError as exc:
                self._refused(f"it answers, but not as expected: {exc.detail}")
            except ConfigError as exc:
                self._refused(str(exc))

    async def stop(self) -> None:
        instance, self.instance = self.instance, None
        if instance is not None:
            await instance.stop(self.settings.drain_timeout)
        self.state = ServerState.STOPPED
        self.changed.set()
