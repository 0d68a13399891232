"""The KV push router's per-request work: the routing explanation only for a client that
asked (``EXPLAIN_ROUTING_METADATA``), the prompt hashed once per request whatever the stages
that route it, and every decision timed for ``/metrics``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest

from turnout.frontend.metrics.frontend import FrontendMetrics
from turnout.protocols.llm import FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import EndpointId
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.push import KvPushRouter
from turnout.router.kv.router import KvRouter
from turnout.runtime.context import EXPLAIN_ROUTING_METADATA, RequestContext
from turnout.runtime.event_plane.local import LocalEventPlane

ENDPOINT = EndpointId(namespace="ns", component="backend", name="generate")
_encode = msgspec.msgpack.Encoder().encode


class Workers:
    """Two workers that each answer one token and a finish."""

    def instance_ids(self) -> list[int]:
        return [1, 2]

    def announced_ids(self) -> set[int]:
        return {1, 2}

    async def stream(
        self, instance_id: int, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]:
        yield _encode(LLMEngineOutput(token_ids=[7], finish_reason=FinishReason.LENGTH))

    def add_listener(self, listener: Callable[[], None]) -> None:
        pass

    def remove_listener(self, listener: Callable[[], None]) -> None:
        pass


def make_router() -> KvRouter:
    return KvRouter(
        KvRouterConfig(block_size=4, use_kv_events=False),
        Workers(),  # type: ignore[arg-type]
        LocalEventPlane(),
        ENDPOINT,
        share_active=False,
    )


def request(tokens: list[int], **kwargs: Any) -> PreprocessedRequest:
    return PreprocessedRequest(model="m", token_ids=tokens, **kwargs)


async def drain(push: KvPushRouter, req: PreprocessedRequest, ctx: RequestContext) -> None:
    async for _ in push.generate(req, ctx):
        pass


@pytest.mark.parametrize("asked", [False, True])
async def test_the_explanation_is_built_only_when_asked(asked: bool) -> None:
    push = KvPushRouter(make_router())
    ctx = RequestContext()
    if asked:
        ctx.metadata[EXPLAIN_ROUTING_METADATA] = True
    await drain(push, request(list(range(16))), ctx)
    assert ctx.metadata["worker_instance_id"] in (1, 2)
    if asked:
        routing = ctx.metadata["routing"]
        assert routing["block_size"] == 4 and routing["new_blocks"] == 4
        assert sorted(c["worker_id"] for c in routing["candidates"]) == ["1", "2"]
    else:
        assert "routing" not in ctx.metadata


async def test_a_prompt_is_hashed_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    router = make_router()
    push = KvPushRouter(router)
    hashed: list[int] = []
    real = router.core.seq_hashes

    def counting(tokens: Any, **kwargs: Any) -> Any:
        hashed.append(len(tokens))
        return real(tokens, **kwargs)

    monkeypatch.setattr(router.core, "seq_hashes", counting)
    ctx = RequestContext()
    prompt = request(list(range(16)))
    selection = push.select(prompt, ctx)  # a prefill router decides with it...
    stage = msgspec.structs.replace(prompt, stop_conditions=prompt.stop_conditions)
    router.on_finished(ctx.request_id)
    push.select(stage, ctx)  # ...and another stage routes the same prompt
    router.on_finished(ctx.request_id)
    assert selection.ok and hashed == [16]
    await drain(push, request(list(range(16)), backend_instance_id=2), ctx)  # booked
    assert hashed == [16, 16]  # another token list: hashed afresh
    await drain(push, prompt.continued([99]), ctx)  # a continued prompt: other tokens
    assert hashed == [16, 16, 17]
    salted = msgspec.structs.replace(prompt, cache_salt="tenant")
    push.select(salted, ctx)  # another partition of the same tokens
    assert hashed == [16, 16, 17, 16]
    assert len(router.core.active) == 1


async def test_decisions_are_timed_and_exported() -> None:
    router = make_router()
    push = KvPushRouter(router)
    for i in range(3):
        await drain(push, request(list(range(8 + i))), RequestContext())
    metrics = FrontendMetrics()
    metrics.watch_kv_routers({"m": router})
    text = metrics.render().decode()
    assert 'turnout_kv_router_decision_seconds_count{model="m"} 3.0' in text
    assert 'turnout_kv_router_decision_seconds_bucket{le="1e-05",model="m"}' in text
    assert 'turnout_kv_router_decision_seconds_bucket{le="+Inf",model="m"} 3.0' in text
    assert router.decision_seconds.count == 3
