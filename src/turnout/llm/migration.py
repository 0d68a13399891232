"""Migration: when a worker dies, stalls or fails mid-stream, continue the request elsewhere.

The re-issued request is the original prompt with every token generated so far appended,
and ``max_tokens`` / ``min_tokens`` reduced by what was already produced, so the client sees
one seamless stream: no token lost, none repeated. Requests pinned to one instance, cancelled
requests and requests that failed for a reason of their own (bad input) are never migrated.

What counts as a broken stream (migrated, up to ``migration_limit`` times, once the request
has tokens; before its first token see below):

* ``StreamBroken`` from the request plane (the peer vanished, went silent, or aborted);
* an ``ERROR`` output of kind ``engine_failed`` (the worker's engine died under the request;
  tokens the worker merged into that output reach the client first, and count as generated);
* a **stall**: no output for ``ttft_timeout`` seconds after an attempt started, or for
  ``stall_timeout`` seconds after its last output. The stalled attempt is cancelled (the
  worker is told) and its instance is set aside (``report_down``).

Before the first token there is nothing to continue: the request simply starts again on
another instance, and the instances it failed on are listed under ``AVOID_METADATA`` in its
context, which the routers below leave out. How often depends on what happened there:

* a refusal, where nothing ran (``overloaded``): the instance is also reported busy
  (``report_busy``) so that other requests skip it for a while, and the request goes on to
  another without spending the migration budget, while an untried instance remains (at most
  ``MAX_AVOIDED``); when none is left the refusal is raised (``EngineOverloaded``, 503).
  An unreachable instance (``PeerUnavailable``, nothing was delivered) is the push router's
  business and never reaches here;
* a failure where the engine ran (a broken stream, ``engine_failed``, a TTFT stall): the
  first ``FIRST_TOKEN_RETRIES`` go elsewhere without spending the budget, the rest spend it
  as mid-stream failures do. A prompt that crashes engines or is slower than the TTFT limit
  everywhere so costs a bounded number of instances, never every one.

Either way the request's deadline must allow it, and when the routers find no instance left
the last failure is raised. A pinned request is never sent elsewhere. The avoided instances
matter only for starting the request: a migration after its first token may go to any
instance (one that refused it moments ago may well have room now).

Deadlines: ``request_timeout`` (or the request's own ``request_timeout``) bounds the whole
request, migrations included; past it the attempt is cancelled and ``RequestTimedOut`` is
raised. The other error kinds become exceptions the HTTP layer maps: ``bad_request`` ->
``EngineBadRequest`` (400), ``overloaded`` (when no other instance is left to try) ->
``EngineOverloaded`` (503 with Retry-After).

Cost on the per-token path: with no timeout configured, none (the plain loop). Otherwise one
``_Watchdog`` per request: a single timer re-armed lazily (when it fires early it moves
itself to the next possible expiry), and per output three attribute writes and one clock
read. No task or timer is created per token. The timer cancels the consuming task only while
it is awaiting the upstream; time the consumer spends elsewhere (writing to a slow client)
never counts as a worker stall.

Placement: turnout runs migration *below* the detokenizing backend, so the backend's decoder
(and its stop-string state) spans the whole request across migrations.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from turnout.errors import (
    EngineBadRequest,
    EngineOverloaded,
    NoInstanceAvailable,
    RequestTimedOut,
    StreamBroken,
)
from turnout.protocols.llm import ErrorKind, FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.runtime import tracing
from turnout.runtime.context import (
    AVOID_METADATA,
    DEADLINE_METADATA,
    MAX_AVOIDED,
    STALLED_METADATA,
    RequestContext,
)

log = logging.getLogger("turnout.migration")

EngineFn = Callable[[PreprocessedRequest, RequestContext], AsyncIterator[LLMEngineOutput]]
T = TypeVar("T")

_ERROR = FinishReason.ERROR
_ENGINE_FAILED = ErrorKind.ENGINE_FAILED.value
_BAD_REQUEST = ErrorKind.BAD_REQUEST.value
_OVERLOADED = ErrorKind.OVERLOADED.value

#: Failures where the engine ran (not refusals) before the first token that send the request
#: elsewhere without spending the migration budget.
FIRST_TOKEN_RETRIES = 2

#: Why a watchdog fired.
_DEADLINE = "deadline"
_STALL = "stall"


class _Watchdog:
    """One request's timer: the request deadline and the per-attempt stall limit.

    Written by the stream loop: ``since`` (when the current wait for the upstream began),
    ``limit`` (the allowed silence: TTFT before an attempt's first output, then the stall
    timeout; ``inf`` for none), ``waiting`` (awaiting the upstream now). Written by the
    timer: ``fired`` (why it cancelled the task), read and cleared by the loop. A stall is
    also marked in ``ctx`` (``STALLED_METADATA``) before the cancellation, for the stages below.
    """

    __slots__ = (
        "_ctx",
        "_handle",
        "_loop",
        "_task",
        "deadline",
        "fired",
        "limit",
        "since",
        "waiting",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        task: asyncio.Task[object],
        ctx: RequestContext | None = None,
    ) -> None:
        self._loop = loop
        self._task = task
        self._ctx = ctx
        self._handle: asyncio.TimerHandle | None = None
        self.deadline = math.inf
        self.limit = math.inf
        self.since = loop.time()
        self.waiting = False
        self.fired: str | None = None

    def arm(self) -> None:
        """(Re)arm the timer for the earliest moment something can expire."""
        when = min(self.deadline, self.since + self.limit)
        if when == math.inf:
            return
        handle = self._handle
        if handle is not None:
            if handle.when() <= when:
                return  # an earlier check is already due; it re-arms itself
            handle.cancel()
        self._handle = self._loop.call_at(when, self._check)

    def _check(self) -> None:
        self._handle = None
        if self.fired is not None:
            return
        now = self._loop.time()
        if self.waiting:
            if now >= self.deadline:
                self.fired = _DEADLINE
            elif now >= self.since + self.limit:
                self.fired = _STALL
                if self._ctx is not None:
                    self._ctx.metadata[STALLED_METADATA] = True
            if self.fired is not None:
                self._task.cancel()
                return
            self.arm()
        else:
            # The consumer holds the stream (e.g. writing to a slow client): nothing can
            # stall now; look again after the shortest limit. The deadline is checked when
            # the loop next waits.
            if min(self.deadline, now + self.limit) < math.inf:
                self._handle = self._loop.call_at(min(self.deadline, now + self.limit), self._check)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class _Progress:
    """One request's state across its attempts: the tokens it received, the migrations it
    spent, and (before its first token) the instances it failed on, the failures where the
    engine ran that it was sent elsewhere for unbudgeted, and the last failure."""

    __slots__ = ("avoid", "failure", "first_token_retries", "generated", "migrations")

    def __init__(self) -> None:
        self.generated: list[int] = []
        self.migrations = 0
        self.first_token_retries = 0
        self.avoid: set[int] = set()
        self.failure: StreamBroken | EngineOverloaded | None = None


class Migration:
    """See the module docstring. Timeouts are seconds; 0 (or None) means none."""

    def __init__(
        self,
        inner: EngineFn,
        *,
        migration_limit: int,
        on_migration: Callable[[], None] | None = None,
        request_timeout: float | None = None,
        ttft_timeout: float | None = None,
        stall_timeout: float | None = None,
        report_down: Callable[[int], None] | None = None,
        report_busy: Callable[[int], None] | None = None,
    ) -> None:
        """``report_down(instance)``: set an instance aside (it stalled or its engine
        failed); ``report_busy(instance)``: it answered ``overloaded`` (the push router's
        ``InstanceLoad.mark_busy``)."""
        for name, value in (
            ("request_timeout", request_timeout),
            ("ttft_timeout", ttft_timeout),
            ("stall_timeout", stall_timeout),
        ):
            if value is not None and not (value >= 0):
                raise ValueError(f"{name} must be >= 0 (0: none), got {value!r}")
        self._inner = inner
        self._limit = migration_limit
        self._on_migration = on_migration
        self._request_timeout = request_timeout or 0.0
        self._ttft = ttft_timeout or math.inf
        self._stall = stall_timeout or math.inf
        self._report_down = report_down
        self._report_busy = report_busy

    def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        """The request's output stream (an async generator: ``aclose()`` it)."""
        # The client may shorten the operator's deadline, never lift it.
        asked, limit = request.request_timeout, self._request_timeout
        timeout = min(asked, limit) if asked and limit else (asked or limit)
        if not timeout and self._ttft == math.inf and self._stall == math.inf:
            return self._generate_plain(request, ctx)
        return self._generate_timed(request, ctx, timeout)

    async def _generate_plain(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        """No timeouts: the plain loop, with error kinds."""
        progress = _Progress()
        generated = progress.generated
        attempt = request
        while True:
            stream = self._inner(attempt, ctx)
            try:
                async for output in stream:
                    if output.finish_reason is _ERROR and output.error_kind is not None:
                        if output.token_ids:  # what came before the error: the client's
                            generated.extend(output.token_ids)
                            yield _tokens_of(output)
                        self._raise_for_kind(output, ctx)
                    if output.token_ids:
                        generated.extend(output.token_ids)
                    yield output
                return
            except (StreamBroken, EngineOverloaded) as exc:
                attempt = self._next_attempt(exc, request, ctx, progress, math.inf)
            except NoInstanceAvailable as exc:
                # Every instance left failed this request before its first token.
                if progress.failure is None or generated:
                    raise
                raise progress.failure from exc
            finally:
                await stream.aclose()  # type: ignore[attr-defined]

    async def _generate_timed(
        self, request: PreprocessedRequest, ctx: RequestContext, timeout: float
    ) -> AsyncIterator[LLMEngineOutput]:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        time = loop.time
        watch = _Watchdog(loop, task, ctx)
        if timeout:
            watch.deadline = ctx.metadata[DEADLINE_METADATA] = time() + timeout
        ttft, stall = self._ttft, self._stall
        progress = _Progress()
        generated = progress.generated
        attempt = request
        try:
            while True:
                stream = self._inner(attempt, ctx)
                anext_ = stream.__anext__
                watch.limit = ttft
                rearm = True  # a new attempt: its TTFT limit may be sooner than the timer
                try:
                    while True:
                        now = watch.since = time()
                        if now >= watch.deadline:
                            raise self._timed_out(ctx, timeout, len(generated))
                        watch.waiting = True
                        if rearm or watch._handle is None:
                            # Otherwise the pending timer is due no later than needed (the
                            # wait starts later than before, the limit is unchanged) and it
                            # moves itself when it fires early: nothing to do per token.
                            watch.arm()
                            rearm = False
                        try:
                            output = await anext_()
                        except StopAsyncIteration:
                            return
                        except asyncio.CancelledError:
                            fired, watch.fired = watch.fired, None
                            ctx.metadata.pop(STALLED_METADATA, None)
                            if fired is None or task.uncancel() > 0:
                                raise
                            if fired == _DEADLINE:
                                raise self._timed_out(ctx, timeout, len(generated)) from None
                            instance = ctx.metadata.get("worker_instance_id")
                            if self._report_down is not None and isinstance(instance, int):
                                self._report_down(instance)
                            limit = watch.limit
                            raise StreamBroken(
                                f"no output for {limit:g}s "
                                f"({'time to first token' if limit == ttft else 'stall'})"
                                + (
                                    f" from instance {instance:x}"
                                    if isinstance(instance, int)
                                    else ""
                                )
                            ) from None
                        finally:
                            watch.waiting = False
                        if watch.limit != stall:
                            watch.limit = stall
                            rearm = True
                        if output.finish_reason is _ERROR and output.error_kind is not None:
                            if output.token_ids:  # what came before the error: the client's
                                generated.extend(output.token_ids)
                                yield _tokens_of(output)
                            self._raise_for_kind(output, ctx)
                        if output.token_ids:
                            generated.extend(output.token_ids)
                        yield output
                except (StreamBroken, EngineOverloaded) as exc:
                    attempt = self._next_attempt(exc, request, ctx, progress, watch.deadline)
                except NoInstanceAvailable as exc:
                    if progress.failure is None or generated:
                        raise
                    raise progress.failure from exc
                finally:
                    await stream.aclose()  # type: ignore[attr-defined]
        finally:
            watch.close()

    def _raise_for_kind(self, output: LLMEngineOutput, ctx: RequestContext) -> None:
        """Turn an ``ERROR`` output with a kind into the exception the layers above act on
        (``StreamBroken`` for a failed engine, ``EngineOverloaded`` for a refusal: the
        caller sends the request elsewhere or gives up)."""
        kind = output.error_kind
        message = output.error or "the engine reported an error"
        if kind == _ENGINE_FAILED:
            instance = ctx.metadata.get("worker_instance_id")
            if self._report_down is not None and isinstance(instance, int):
                self._report_down(instance)
            raise StreamBroken(f"engine failed: {message}")
        if kind == _BAD_REQUEST:
            raise EngineBadRequest(message)
        if kind == _OVERLOADED:
            instance = ctx.metadata.get("worker_instance_id")
            if self._report_busy is not None and isinstance(instance, int):
                self._report_busy(instance)
            raise EngineOverloaded(f"worker overloaded: {message}")

    def _next_attempt(
        self,
        exc: StreamBroken | EngineOverloaded,
        request: PreprocessedRequest,
        ctx: RequestContext,
        progress: _Progress,
        deadline: float,
    ) -> PreprocessedRequest:
        """The request to send after ``exc`` ended an attempt, or ``exc`` raised: the same
        request elsewhere before the first token (unbudgeted for a refusal and the first
        ``FIRST_TOKEN_RETRIES`` failures, then counted), else a migration (counted)."""
        generated = progress.generated
        if isinstance(exc, EngineOverloaded):
            if not generated and self._send_elsewhere(exc, request, ctx, progress, deadline):
                return request
            raise exc
        if generated:
            # Instances avoided for starting the request are candidates again.
            progress.avoid.clear()
            ctx.metadata.pop(AVOID_METADATA, None)
            progress.migrations = self._migrate(exc, request, ctx, progress.migrations, generated)
            return request.continued(generated)
        if progress.first_token_retries < FIRST_TOKEN_RETRIES and self._send_elsewhere(
            exc, request, ctx, progress, deadline
        ):
            progress.first_token_retries += 1
            return request
        progress.migrations = self._migrate(exc, request, ctx, progress.migrations, generated)
        self._avoid(ctx, progress)
        progress.failure = exc
        return request

    def _send_elsewhere(
        self,
        exc: StreamBroken | EngineOverloaded,
        request: PreprocessedRequest,
        ctx: RequestContext,
        progress: _Progress,
        deadline: float,
    ) -> bool:
        """Whether a request without tokens yet may start again on another instance without
        spending the migration budget (its failed instance added to the ones the routers
        avoid). A refusal needs to know which instance refused; a failure need not (a
        prefill worker that stalled is set aside by the prefill router)."""
        if ctx.is_cancelled or request.backend_instance_id is not None:
            return False
        instance = ctx.metadata.get("worker_instance_id")
        if isinstance(instance, int):
            if instance in progress.avoid or len(progress.avoid) >= MAX_AVOIDED:
                return False
        elif isinstance(exc, EngineOverloaded):
            return False
        if deadline != math.inf and asyncio.get_running_loop().time() >= deadline:
            return False
        self._avoid(ctx, progress)
        progress.failure = exc
        tracing.moved(ctx, "retry", str(exc), {"turnout.avoided": len(progress.avoid)})
        log.warning(
            "request %s: instance %s failed before the first token (%s); trying another "
            "(%d avoided)",
            ctx.request_id,
            f"{instance:x}" if isinstance(instance, int) else "?",
            exc,
            len(progress.avoid),
        )
        return True

    @staticmethod
    def _avoid(ctx: RequestContext, progress: _Progress) -> None:
        """List the attempt's instance (if known, under ``MAX_AVOIDED``) among the ones the
        routers leave out for this request."""
        instance = ctx.metadata.pop("worker_instance_id", None)
        avoid = progress.avoid
        if isinstance(instance, int) and len(avoid) < MAX_AVOIDED:
            avoid.add(instance)
            ctx.metadata[AVOID_METADATA] = avoid

    def _migrate(
        self,
        exc: StreamBroken,
        request: PreprocessedRequest,
        ctx: RequestContext,
        migrations: int,
        generated: list[int],
    ) -> int:
        """Count one migration, or re-raise ``exc`` when the request may not move.

        A structured output that has begun cannot move: the engine would start its grammar
        afresh after the generated prefix, and the whole would match nothing."""
        if migrations >= self._limit or ctx.is_cancelled or request.backend_instance_id is not None:
            raise exc
        if request.structured is not None and generated:
            log.warning(
                "request %s: stream broke after %d tokens of %s output (%s); a constrained "
                "output cannot resume elsewhere",
                ctx.request_id,
                len(generated),
                request.structured.kind,
                exc,
            )
            raise exc
        migrations += 1
        ctx.metadata["migrations"] = migrations
        if self._on_migration is not None:
            self._on_migration()
        tracing.moved(
            ctx,
            "migration",
            str(exc),
            {"turnout.tokens_generated": len(generated), "turnout.migration": migrations},
        )
        log.warning(
            "request %s: stream broke after %d tokens (%s); migrating (%d/%d)",
            ctx.request_id,
            len(generated),
            exc,
            migrations,
            self._limit,
        )
        return migrations

    @staticmethod
    def _timed_out(
        ctx: RequestContext, timeout: float, produced: int, what: str = "tokens"
    ) -> RequestTimedOut:
        log.warning(
            "request %s: deadline of %gs passed after %d %s; cancelled",
            ctx.request_id,
            timeout,
            produced,
            what,
        )
        return RequestTimedOut(
            f"the request did not finish within its {timeout:g}s deadline "
            f"({produced} {what} generated)"
        )


def _tokens_of(output: LLMEngineOutput) -> LLMEngineOutput:
    """The tokens an ``ERROR`` output carries (a worker merges the last tokens before an
    error into it), without the error."""
    return LLMEngineOutput(
        token_ids=output.token_ids,
        log_probs=output.log_probs,
        top_logprobs=output.top_logprobs,
        text=output.text,
    )


async def deadline_stream(
    stream: AsyncIterator[T], timeout: float, ctx: RequestContext
) -> AsyncIterator[T]:
    """``stream`` bounded by a deadline ``timeout`` seconds from now (for pipelines without
    migration, e.g. router-only text models): past it, the upstream is cancelled and
    ``RequestTimedOut`` is raised. Same one-timer watchdog as ``Migration``."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    watch = _Watchdog(loop, task)
    watch.deadline = loop.time() + timeout
    anext_ = stream.__anext__
    count = 0
    try:
        while True:
            if loop.time() >= watch.deadline:
                raise Migration._timed_out(ctx, timeout, count, "chunks")
            watch.waiting = True
            if watch._handle is None:
                watch.arm()
            try:
                item = await anext_()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                fired, watch.fired = watch.fired, None
                if fired is None or task.uncancel() > 0:
                    raise
                raise Migration._timed_out(ctx, timeout, count, "chunks") from None
            finally:
                watch.waiting = False
            count += 1
            yield item
    finally:
        watch.close()
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
