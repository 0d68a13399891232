"""One request, one reply: how embedding and tensor requests reach a worker.

Generation requests migrate token by token (``llm.migration``); a unary request has nothing
to carry over, so a failed attempt is simply sent again, to another instance: when its
stream breaks, when the worker's engine reports ``engine_failed`` (that instance is set
aside), up to ``retries`` times. A request pinned to an instance is not moved. The whole
exchange, retries included, runs under the request's deadline.

An ``overloaded`` reply sends the request to another instance (not counted as a retry): the
instance is reported busy (``report_busy``) and listed under ``AVOID_METADATA``, which the
push router leaves out. When no instance is left to try, or the deadline passes after such a
refusal, the answer is ``EngineOverloaded`` (503).

A reply's ``error_kind`` becomes the exception the HTTP layer maps: ``bad_request`` ->
``EngineBadRequest`` (400), ``overloaded`` -> ``EngineOverloaded`` (503), no kind ->
``RemoteError`` (500).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

from turnout.errors import (
    EngineBadRequest,
    EngineOverloaded,
    NoInstanceAvailable,
    RemoteError,
    RequestTimedOut,
    StreamBroken,
)
from turnout.protocols.llm import ErrorKind
from turnout.protocols.unary import UnaryReply
from turnout.router.push_router import PIN_METADATA
from turnout.runtime.context import AVOID_METADATA, MAX_AVOIDED, RequestContext

log = logging.getLogger("turnout.router")

Req = TypeVar("Req")
Reply = TypeVar("Reply", bound=UnaryReply)


class UnaryCaller(Generic[Req, Reply]):
    """Send a request through ``generate`` (a router's) and return the worker's one reply."""

    def __init__(
        self,
        generate: Callable[[Req, RequestContext], AsyncIterator[Reply]],
        *,
        retries: int = 3,
        request_timeout: float = 0.0,
        report_down: Callable[[int], None] | None = None,
        report_busy: Callable[[int], None] | None = None,
        on_retry: Callable[[], None] | None = None,
    ) -> None:
        self._generate = generate
        self._retries = retries
        self._timeout = request_timeout
        self._report_down = report_down
        self._report_busy = report_busy
        self._on_retry = on_retry

    async def call(self, request: Req, ctx: RequestContext, timeout: float | None = None) -> Reply:
        """The reply; ``timeout`` (seconds, > 0) shortens the caller's deadline, never lifts
        it. Past the deadline: ``RequestTimedOut`` (504), the work cancelled."""
        limit = self._timeout
        deadline = min(timeout, limit) if timeout and limit else (timeout or limit)
        avoid: set[int] = set()
        if not deadline:
            return await self._call(request, ctx, avoid)
        try:
            async with asyncio.timeout(deadline):
                return await self._call(request, ctx, avoid)
        except TimeoutError:
            ctx.cancel()
            if avoid:
                raise EngineOverloaded(
                    f"{len(avoid)} instances answered overloaded and the {deadline:g}s "
                    "deadline passed"
                ) from None
            raise RequestTimedOut(
                f"the request did not finish within its {deadline:g}s deadline"
            ) from None

    async def _call(self, request: Req, ctx: RequestContext, avoid: set[int]) -> Reply:
        """``avoid``: filled with the instances that answered ``overloaded``."""
        attempts = 0
        while True:
            try:
                try:
                    reply = await self._one(request, ctx)
                except NoInstanceAvailable as exc:
                    if avoid and not isinstance(exc, EngineOverloaded):
                        raise EngineOverloaded(
                            f"every instance tried answered overloaded ({len(avoid)}): {exc}"
                        ) from exc
                    raise
                kind = reply.error_kind
                if kind == ErrorKind.ENGINE_FAILED:
                    instance = ctx.metadata.get("worker_instance_id")
                    if self._report_down is not None and isinstance(instance, int):
                        self._report_down(instance)
                    raise StreamBroken(f"engine failed: {reply.error}")
            except StreamBroken as exc:
                pinned = ctx.metadata.get(PIN_METADATA) is not None
                if attempts >= self._retries or pinned or ctx.is_cancelled:
                    raise
                attempts += 1
                if self._on_retry is not None:
                    self._on_retry()
                log.warning(
                    "request %s: %s; sending it again (%d/%d)",
                    ctx.request_id,
                    exc,
                    attempts,
                    self._retries,
                )
                continue
            if reply.error is None:
                return reply
            if kind == ErrorKind.BAD_REQUEST:
                raise EngineBadRequest(reply.error)
            if kind == ErrorKind.OVERLOADED:
                if self._elsewhere(ctx, avoid):
                    continue
                raise EngineOverloaded(f"worker overloaded: {reply.error}")
            raise RemoteError(reply.error)

    def _elsewhere(self, ctx: RequestContext, avoid: set[int]) -> bool:
        """After an ``overloaded`` reply: report its instance busy and whether the request
        may go to another (not pinned, instance known, under the bound)."""
        instance = ctx.metadata.get("worker_instance_id")
        if not isinstance(instance, int):
            return False
        if self._report_busy is not None:
            self._report_busy(instance)
        pinned = ctx.metadata.get(PIN_METADATA) is not None
        if pinned or ctx.is_cancelled or instance in avoid or len(avoid) >= MAX_AVOIDED:
            return False
        avoid.add(instance)
        ctx.metadata[AVOID_METADATA] = avoid
        log.warning(
            "request %s: instance %x answered overloaded; trying another", ctx.request_id, instance
        )
        return True

    async def _one(self, request: Req, ctx: RequestContext) -> Reply:
        stream = self._generate(request, ctx)
        try:
            async for reply in stream:
                return reply
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        raise StreamBroken("the worker ended its stream without a reply")
