"""Session affinity (hard binding), as Dynamo's ``SessionAffinityPushRouter`` does.

With ``--router-session-affinity-ttl-secs N``, a request's session id (``x-session-id`` or a
coding agent's session header, read by the frontend) binds its session to the instance that
served the session's first request; every later request of the session is pinned there.

Lifecycle of one binding (all transitions in ``SessionTable``)::

    (none) --first request--> PENDING --first output--> BOUND(instance) <--> IDLE
       ^                          |                        |                  |
       +-- first request failed --+   instance left / -----+     idle TTL, ---+
                                      unreachable / broke         LRU eviction

* PENDING: the first request is routing. Concurrent requests of the session wait for its
  decision (bounded by ``bind_wait_s``) instead of scattering; if the first request fails
  before any output, the binding is dropped and the next waiter routes afresh.
* BOUND: requests in flight hold the binding; it never expires while one is in flight.
* IDLE: no request in flight; it expires ``ttl_s`` after the last one ended.
* A bound instance that discovery no longer lists as live (gone, or set aside after a
  failure), that cannot be reached, or whose stream broke, frees the binding: the request
  routes afresh and re-binds.

Caps: at most ``max_sessions`` bindings (65,536 by default, as Dynamo); the least recently
idle one is evicted for a new session; when every binding has a request in flight, a new
session routes without binding (counted in ``num_refused``). Session ids are capped in
length at the HTTP edge (256 characters, as Dynamo's 256 bytes).

The affinity pin lives only on the copy of the request handed to the router below, never
on the request that migration holds: migration never moves a *client's* explicit pin
(``nvext.backend_instance_id``), but a bound session's request whose worker dies mid-stream
migrates like any other (the broken stream freed the binding; the continuation routes afresh
and re-binds the session to its new instance). A client pin that names another instance
than the session's binding is a 400 naming ``nvext.backend_instance_id``.

A session's requests for a LoRA adapter have a binding of their own (to an instance that
holds the adapter), apart from its requests for the base model.

In ``kv`` mode a bound request skips the KV decision (pinned requests are not scored), so the
hard binding wins over the soft session preference of ``--router-session-weight``; the KV
router still books it on its instance, so its load weighs on the next decisions.

A request that migration sends elsewhere before its first token (its instance failed it or
answered ``overloaded``: ``AVOID_METADATA``) is not pinned to a binding on such an instance:
it routes afresh, and the binding stays. A binding is made by the first request's first
output that is not an error (an ``overloaded`` refusal binds nothing).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from turnout.errors import InstanceNotFound, NoInstanceAvailable, RequestError, StreamBroken
from turnout.protocols.llm import FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.router.push_router import PIN_PARAM, LiveInstances
from turnout.runtime.context import AVOID_METADATA, RequestContext

log = logging.getLogger("turnout.router.session_affinity")

EngineFn = Callable[[PreprocessedRequest, RequestContext], AsyncIterator[LLMEngineOutput]]
Clock = Callable[[], float]

#: Default cap on the number of bound sessions per model (Dynamo's
#: ``MAX_SESSION_AFFINITY_ENTRIES``).
DEFAULT_MAX_SESSIONS = 65_536
#: The longest idle TTL accepted: a year (Dynamo's ``MAX_SESSION_AFFINITY_TTL_SECS``).
MAX_TTL_S = 31_536_000.0
#: Default bound on how long a request waits for its session's first routing decision.
DEFAULT_BIND_WAIT_S = 30.0
#: ``RequestContext.metadata`` key: the instance session affinity pinned the request to.
AFFINITY_METADATA = "session_affinity_instance_id"


class BindingState(enum.Enum):
    PENDING = "pending"
    BOUND = "bound"
    IDLE = "idle"
    #: Out of the table (expired, evicted, freed); requests still holding it only release.
    DETACHED = "detached"


@dataclass(slots=True, eq=False)
class Binding:
    """One session's binding. Every field is written by ``SessionTable`` only."""

    session_id: str
    state: BindingState
    instance_id: int | None = None
    #: Requests of the session holding this binding (the pending leader counts).
    inflight: int = 0
    #: When the last request ended (meaningful while IDLE).
    idle_since: float = 0.0
    #: Set once a PENDING binding is decided (bound or dropped).
    decided: asyncio.Event = field(default_factory=asyncio.Event)


class SessionTable:
    """The bindings of one model, shared by its chat and completions pipelines.

    Synchronous except for ``asyncio.Event`` the waiters use; the clock is injected.
    Invariants: a binding is in ``_active`` (PENDING/BOUND) or ``_idle`` (IDLE, ordered by
    ``idle_since``, oldest first) or in neither (DETACHED); ``len(_active) + len(_idle) <=
    max_sessions``.
    """

    def __init__(
        self,
        ttl_s: float,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        clock: Clock = time.monotonic,
    ) -> None:
        if not (0 < ttl_s <= MAX_TTL_S):
            raise ValueError(
                f"session affinity TTL must be seconds > 0 and <= {MAX_TTL_S:g}, got {ttl_s}"
            )
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._active: dict[str, Binding] = {}
        self._idle: OrderedDict[str, Binding] = OrderedDict()
        #: New sessions routed without a binding because every binding was in use.
        self.num_refused = 0
        #: Bindings freed because their instance left, was unreachable, or broke a stream.
        self.num_rebound = 0

    def __len__(self) -> int:
        return len(self._active) + len(self._idle)

    def get(self, session_id: str) -> Binding | None:
        """The session's live binding (expiring idle ones first), or None."""
        self._expire()
        binding = self._active.get(session_id)
        return binding if binding is not None else self._idle.get(session_id)

    def _expire(self) -> None:
        horizon = self._clock() - self.ttl_s
        idle = self._idle
        while idle:
            binding = next(iter(idle.values()))
            if binding.idle_since > horizon:
                return
            idle.popitem(last=False)
            binding.state = BindingState.DETACHED

    def start(self, session_id: str) -> Binding | None:
        """A PENDING binding led by the caller (counted in flight), or None when the table
        is full of bindings in use (the request routes without one; counted)."""
        self._expire()
        assert session_id not in self._active and session_id not in self._idle
        if len(self) >= self.max_sessions:
            if not self._idle:
                self.num_refused += 1
                return None
            _, evicted = self._idle.popitem(last=False)  # least recently idle
            evicted.state = BindingState.DETACHED
        binding = Binding(session_id, BindingState.PENDING, inflight=1)
        self._active[session_id] = binding
        return binding

    def bind(self, binding: Binding, instance_id: int) -> None:
        """The leader's request reached ``instance_id``: later requests go there."""
        if binding.state is BindingState.PENDING:
            binding.state = BindingState.BOUND
            binding.instance_id = instance_id
        binding.decided.set()

    def join(self, binding: Binding) -> None:
        """One more request in flight on a BOUND or IDLE binding."""
        if binding.state is BindingState.IDLE:
            del self._idle[binding.session_id]
            self._active[binding.session_id] = binding
            binding.state = BindingState.BOUND
        elif binding.state is not BindingState.BOUND:
            raise ValueError(f"cannot join a {binding.state.value} binding")
        binding.inflight += 1

    def release(self, binding: Binding) -> None:
        """A request holding ``binding`` ended; the last one starts the idle TTL."""
        binding.inflight -= 1
        if binding.state is BindingState.PENDING:
            # The leader ended before the binding was decided: drop it, wake the waiters.
            self.free(binding)
            return
        if binding.inflight > 0 or binding.state is not BindingState.BOUND:
            return
        del self._active[binding.session_id]
        binding.state = BindingState.IDLE
        binding.idle_since = self._clock()
        self._idle[binding.session_id] = binding

    def free(self, binding: Binding, *, rebound: bool = False) -> None:
        """Drop ``binding`` from the table (its instance is gone, or its first request
        failed); requests still holding it just release it later."""
        if binding.state is BindingState.DETACHED:
            return
        if binding.state is BindingState.IDLE:
            del self._idle[binding.session_id]
        else:
            del self._active[binding.session_id]
        binding.state = BindingState.DETACHED
        binding.decided.set()
        if rebound:
            self.num_rebound += 1


class SessionAffinityRouter:
    """Wraps a router's ``generate`` (same shape): pins a bound session's requests to its
    instance, and binds a new session to the instance its first request lands on."""

    def __init__(
        self,
        inner: EngineFn,
        table: SessionTable,
        client: LiveInstances,
        *,
        bind_wait_s: float = DEFAULT_BIND_WAIT_S,
    ) -> None:
        self._inner = inner
        self.table = table
        self._client = client
        self._bind_wait_s = bind_wait_s

    async def _acquire(self, session_id: str, ctx: RequestContext) -> tuple[Binding | None, bool]:
        """``(binding, leads)``: a binding the request holds (BOUND, or PENDING that the
        request leads), or ``(None, False)`` to route without one."""
        table = self.table
        while True:
            binding = table.get(session_id)
            if binding is None:
                binding = table.start(session_id)
                return binding, binding is not None
            if binding.state is BindingState.PENDING:
                try:
                    await asyncio.wait_for(binding.decided.wait(), self._bind_wait_s)
                except TimeoutError:
                    log.warning(
                        "request %s: session %r still routing its first request after %gs; "
                        "routing without the binding",
                        ctx.request_id,
                        session_id,
                        self._bind_wait_s,
                    )
                    return None, False
                continue  # bound, or dropped (then this request may lead)
            assert binding.instance_id is not None
            if binding.instance_id not in self._client.instance_ids():
                log.info(
                    "request %s: session %r was bound to instance %x, which is gone or set "
                    "aside; re-binding",
                    ctx.request_id,
                    session_id,
                    binding.instance_id,
                )
                table.free(binding, rebound=True)
                continue
            table.join(binding)
            return binding, False

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        session_id = request.session_id
        if session_id is not None and request.lora_name is not None:
            # An adapter's requests bind apart from the base model's: the instance a LoRA
            # request landed on holds the adapter, the base model's may not.
            session_id = f"{session_id}\x00{request.lora_name}"
        if session_id is None:
            stream = self._inner(request, ctx)
            try:
                async for output in stream:
                    yield output
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
            return
        table = self.table
        explicit = request.backend_instance_id
        retried = False
        while True:
            binding, leads = await self._acquire(session_id, ctx)
            try:
                bound_to = None if binding is None or leads else binding.instance_id
                if bound_to is not None and bound_to in ctx.metadata.get(AVOID_METADATA, ()):
                    bound_to = None  # it failed this request: route it elsewhere
                if bound_to is not None and explicit is not None and explicit != bound_to:
                    raise RequestError(
                        f"session {request.session_id!r} is bound to instance {bound_to:x} "
                        f"(session affinity); {PIN_PARAM} names instance {explicit:x}",
                        param=PIN_PARAM,
                    )
                attempt = request
                if bound_to is not None and explicit is None:
                    attempt = msgspec.structs.replace(request, backend_instance_id=bound_to)
                    ctx.metadata[AFFINITY_METADATA] = bound_to
                else:
                    ctx.metadata.pop(AFFINITY_METADATA, None)
                stream = self._inner(attempt, ctx)
                produced = False
                try:
                    async for output in stream:
                        if not produced and output.finish_reason is not FinishReason.ERROR:
                            produced = True
                            served = ctx.metadata.get("worker_instance_id")
                            if leads and binding is not None and isinstance(served, int):
                                table.bind(binding, served)
                        yield output
                    return
                except (NoInstanceAvailable, InstanceNotFound):
                    # The bound instance could not be reached (nothing was delivered):
                    # free the binding and route afresh, once.
                    if produced or bound_to is None or explicit is not None or retried:
                        raise
                    assert binding is not None
                    table.free(binding, rebound=True)
                    retried = True
                    log.info(
                        "request %s: session %r's instance %x is unreachable; re-routing",
                        ctx.request_id,
                        session_id,
                        bound_to,
                    )
                except StreamBroken:
                    # Its instance broke the stream: migration re-issues the request
                    # through here, and the continuation re-binds wherever it lands.
                    if binding is not None and binding.instance_id is not None:
                        table.free(binding, rebound=True)
                    raise
                finally:
                    await stream.aclose()  # type: ignore[attr-defined]
            finally:
                if binding is not None:
                    table.release(binding)
