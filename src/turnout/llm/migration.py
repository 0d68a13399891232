"""Migration: when a worker dies mid-stream, continue the request on another worker.

The re-issued request is the original prompt with every token generated so far appended,
and ``max_tokens`` / ``min_tokens`` reduced by what was already produced, so the client sees
one seamless stream: no token lost, none repeated. Requests pinned to one instance, cancelled
requests and requests that failed for any other reason (bad input, engine error) are never
migrated.

Placement: turnout runs migration *below* the detokenizing backend, so the backend's decoder
(and its stop-string state) spans the whole request across migrations.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import msgspec

from turnout.errors import StreamBroken
from turnout.protocols.llm import LLMEngineOutput, PreprocessedRequest
from turnout.runtime.context import RequestContext

log = logging.getLogger("turnout.migration")

EngineFn = Callable[[PreprocessedRequest, RequestContext], AsyncIterator[LLMEngineOutput]]


class Migration:
    def __init__(
        self,
        inner: EngineFn,
        *,
        migration_limit: int,
        on_migration: Callable[[], None] | None = None,
    ) -> None:
        self._inner = inner
        self._limit = migration_limit
        self._on_migration = on_migration

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        generated: list[int] = []
        attempt = request
        migrations = 0
        while True:
            stream = self._inner(attempt, ctx)
            try:
                async for output in stream:
                    if output.token_ids:
                        generated.extend(output.token_ids)
                    yield output
                return
            except StreamBroken as exc:
                if (
                    migrations >= self._limit
                    or ctx.is_cancelled
                    or request.backend_instance_id is not None
                ):
                    raise
                migrations += 1
                ctx.metadata["migrations"] = migrations
                if self._on_migration is not None:
                    self._on_migration()
                log.warning(
                    "request %s: stream broke after %d tokens (%s); migrating (%d/%d)",
                    ctx.request_id,
                    len(generated),
                    exc,
                    migrations,
                    self._limit,
                )
                attempt = continue_request(request, generated)
            finally:
                await stream.aclose()  # type: ignore[attr-defined]


def continue_request(request: PreprocessedRequest, generated: list[int]) -> PreprocessedRequest:
    """The request that continues ``request`` after ``generated`` tokens."""
    stop = request.stop_conditions
    done = len(generated)
    new_stop = msgspec.structs.replace(
        stop,
        max_tokens=None if stop.max_tokens is None else max(stop.max_tokens - done, 1),
        min_tokens=None if stop.min_tokens is None else max(stop.min_tokens - done, 0),
    )
    return msgspec.structs.replace(
        request,
        token_ids=[*request.token_ids, *generated],
        stop_conditions=new_stop,
    )
