"""Stored responses and conversations through the official ``openai`` client, against real
stacks on SQLite, PostgreSQL and Redis: chains of three turns (``previous_response_id``), two
frontends sharing one store, reading back (``GET``, ``input_items``), deleting, expiry, the
404s, conversations, the query parameters, a chained turn's routing, and openai-agents'
Responses model chaining its turns by itself. Every body is checked against the client's
types by the suite's conformance hook."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tests.frontend.scripted import CITIES, ScriptedToolEngine, final_answer
from tests.frontend.stack import Stack, WholePromptEcho, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.base import Engine
from turnout.protocols.llm import LLMEngineOutput, PreprocessedRequest
from turnout.runtime.context import RequestContext

MakeStack = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def stacks(gguf_path: str) -> AsyncIterator[MakeStack]:
    """Makes stacks with one echo worker (model ``echo``, answering with the whole
    conversation) and the given frontend settings; closes them and checks for leaks."""
    before = set(asyncio.all_tasks())
    made: list[Stack] = []

    async def make(engine: Engine | None = None, **config: Any) -> Stack:
        stack = await make_stack(**config)
        made.append(stack)
        await stack.add_worker(engine or WholePromptEcho(gguf_path), model_name="echo")
        await stack.wait_for_model("echo")
        return stack

    yield make
    for stack in made:
        await stack.close()
    await assert_no_leaked_tasks(before)


@pytest.fixture
async def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A ``--response-store`` of the parametrized kind, empty."""
    kind = request.param
    if kind == "sqlite":
        return f"sqlite:{tmp_path / 'responses.db'}"
    if kind == "postgres":
        return str(await request.getfixturevalue("postgres_server").create_database())
    server = request.getfixturevalue("redis_server")
    import redis.asyncio as aioredis

    client = aioredis.from_url(server.url(9))
    await client.flushdb()
    await client.aclose()
    return str(server.url(9))


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)


def texts(items: list[Any]) -> list[tuple[str, str]]:
    """(role, text) of message items."""
    return [(i.role, "".join(p.text for p in i.content)) for i in items if i.type == "message"]


@pytest.mark.parametrize("store_spec", ["sqlite", "postgres", "redis"], indirect=True)
async def test_a_chain_of_three_turns(stacks: MakeStack, store_spec: str) -> None:
    stack = await stacks(response_store=store_spec)
    api = client(stack)
    first = await api.responses.create(model="echo", input="first question",
                                       max_output_tokens=500)  # fmt: skip
    assert first.store is True
    second = await api.responses.create(
        model="echo", input="second question", previous_response_id=first.id,
        max_output_tokens=500,
    )  # fmt: skip
    # The third streamed: stored before its last event, so it can be read back at once.
    async with api.responses.stream(
        model="echo", input="third question", previous_response_id=second.id,
        max_output_tokens=500,
    ) as stream:  # fmt: skip
        third = await stream.get_final_response()
    assert "first question" in second.output_text and "third" not in second.output_text
    for said in ("first question", "second question", "third question"):
        assert said in third.output_text
    assert third.previous_response_id == second.id
    read = await api.responses.retrieve(third.id)
    assert read.id == third.id and read.output_text == third.output_text and read.store
    # Its input items: every turn's input and output, then its own input; newest first by
    # default, and the client follows the pages (two items a page) with ``after``.
    newest_first = [i async for i in api.responses.input_items.list(third.id, limit=2)]
    oldest_first = [
        i async for i in api.responses.input_items.list(third.id, order="asc", limit=2)
    ]
    assert [i.id for i in newest_first] == [i.id for i in oldest_first][::-1]
    said = texts(oldest_first)
    assert [role for role, _ in said] == ["user", "assistant", "user", "assistant", "user"]
    assert said[0][1] == "first question" and said[-1][1] == "third question"
    assert said[1][1] == first.output_text and said[3][1] == second.output_text
    await api.close()


@pytest.mark.parametrize("store_spec", ["postgres", "redis"], indirect=True)
async def test_two_frontends_share_a_chain(stacks: MakeStack, store_spec: str) -> None:
    """Each frontend has its own workers and discovery; only the store is shared."""
    one, two = await stacks(response_store=store_spec), await stacks(response_store=store_spec)
    api_one, api_two = client(one), client(two)
    first = await api_one.responses.create(model="echo", input="asked of one")
    second = await api_two.responses.create(
        model="echo", input="asked of two", previous_response_id=first.id
    )
    third = await api_one.responses.create(
        model="echo", input="asked of one again", previous_response_id=second.id
    )
    for said in ("asked of one", "asked of two", "asked of one again"):
        assert said in third.output_text
    assert (await api_two.responses.retrieve(third.id)).output_text == third.output_text
    await api_two.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        await api_one.responses.retrieve(third.id)
    await api_one.close()
    await api_two.close()


async def test_deleted_unknown_and_unstored_ids_are_404s(stacks: MakeStack) -> None:
    stack = await stacks()
    api = client(stack)
    kept = await api.responses.create(model="echo", input="keep me")
    unstored = await api.responses.create(model="echo", input="forget me", store=False)
    assert unstored.store is False
    assert await api.responses.delete(kept.id) is None
    async with httpx.AsyncClient(base_url=stack.url) as http:
        for gone in (kept.id, unstored.id, "resp_nothing"):
            for method, path in (("GET", f"/v1/responses/{gone}"),
                                 ("DELETE", f"/v1/responses/{gone}"),
                                 ("GET", f"/v1/responses/{gone}/input_items")):  # fmt: skip
                r = await http.request(method, path)
                assert r.status_code == 404, (method, path, r.text)
                assert r.json() == {"error": {
                    "message": f"Response with id '{gone}' not found.",
                    "type": "invalid_request_error", "param": None, "code": None,
                }}  # fmt: skip
            r = await http.post("/v1/responses", json={
                "model": "echo", "input": "more", "previous_response_id": gone,
            })  # fmt: skip
            assert r.status_code == 404, r.text
            assert r.json()["error"]["param"] == "previous_response_id"
            assert r.json()["error"]["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(kept.id)
    await api.close()


async def test_a_chain_whose_start_was_deleted_is_refused_by_name(stacks: MakeStack) -> None:
    stack = await stacks()
    api = client(stack)
    first = await api.responses.create(model="echo", input="one")
    second = await api.responses.create(model="echo", input="two", previous_response_id=first.id)
    await api.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id) as caught:
        await api.responses.create(model="echo", input="three", previous_response_id=second.id)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    await api.close()


async def test_stored_responses_expire(stacks: MakeStack, tmp_path: Path) -> None:
    """A one-second retention: read back at once, then gone, then swept from the file."""
    db = tmp_path / "responses.db"
    stack = await stacks(response_store=f"sqlite:{db}", response_store_ttl=1.0)
    api = client(stack)
    out = await api.responses.create(model="echo", input="short-lived")
    assert (await api.responses.retrieve(out.id)).id == out.id
    deadline = time.monotonic() + 15
    while True:
        try:
            await api.responses.retrieve(out.id)
        except openai.NotFoundError:
            break
        assert time.monotonic() < deadline, "the response did not expire"
        await asyncio.sleep(0.1)

    def rows() -> int:
        with sqlite3.connect(db) as conn:
            return int(conn.execute("SELECT count(*) FROM turnout_responses").fetchone()[0])

    while rows():  # the sweep (every second, at this retention) removes the row itself
        assert time.monotonic() < deadline, "the expired response was not swept"
        await asyncio.sleep(0.1)
    await api.close()


async def test_a_response_larger_than_the_bound_is_answered_but_not_stored(
    stacks: MakeStack,
) -> None:
    stack = await stacks(response_store_max_bytes=2000)
    api = client(stack)
    small = await api.responses.create(model="echo", input="short")
    large = await api.responses.create(model="echo", input="long " * 300)
    assert small.store is True and large.store is False
    assert "long long" in large.output_text
    await api.responses.retrieve(small.id)
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(large.id)
    await api.close()


async def test_a_conversation_through_the_client(stacks: MakeStack) -> None:
    stack = await stacks()
    api = client(stack)
    conv = await api.conversations.create(
        items=[{"type": "message", "role": "user", "content": "hello from the start"}],
        metadata={"topic": "weather"},
    )
    assert conv.metadata == {"topic": "weather"}
    first = await api.responses.create(model="echo", input="first turn", conversation=conv.id)
    assert first.conversation is not None and first.conversation.id == conv.id
    second = await api.responses.create(
        model="echo", input="second turn", conversation={"id": conv.id}
    )
    assert "hello from the start" in second.output_text and "first turn" in second.output_text
    items = [i async for i in api.conversations.items.list(conv.id, order="asc", limit=3)]
    assert texts(items) == [
        ("user", "hello from the start"),
        ("user", "first turn"),
        ("assistant", first.output_text),
        ("user", "second turn"),
        ("assistant", second.output_text),
    ]
    added = await api.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "user", "content": "added later"}]
    )
    assert texts(added.data) == [("user", "added later")]
    item_id = added.data[0].id  # type: ignore[union-attr]
    item = await api.conversations.items.retrieve(item_id, conversation_id=conv.id)
    assert item.id == item_id  # type: ignore[union-attr]
    after = await api.conversations.items.delete(item_id, conversation_id=conv.id)
    assert after.id == conv.id
    with pytest.raises(openai.NotFoundError):
        await api.conversations.items.retrieve(item_id, conversation_id=conv.id)
    updated = await api.conversations.update(conv.id, metadata={"topic": "rain"})
    assert (await api.conversations.retrieve(conv.id)).metadata == updated.metadata
    assert updated.metadata == {"topic": "rain"}
    deleted = await api.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id
    with pytest.raises(openai.NotFoundError):
        await api.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        await api.responses.create(model="echo", input="late", conversation=conv.id)
    await api.close()


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [
        ("GET", "/v1/responses/{id}/input_items?limit=0", None, 400, "limit"),
        ("GET", "/v1/responses/{id}/input_items?limit=101", None, 400, "limit"),
        ("GET", "/v1/responses/{id}/input_items?order=sideways", None, 400, "order"),
        ("GET", "/v1/responses/{id}/input_items?after=msg_nope", None, 400, "after"),
        ("GET", "/v1/responses/{id}/input_items?include[]=message.output_text.logprobs",
         None, 400, "include"),
        ("GET", "/v1/responses/{id}/input_items?page=2", None, 400, "page"),
        ("GET", "/v1/responses/{id}?stream=true", None, 400, "stream"),
        ("GET", "/v1/responses/{id}?starting_after=3", None, 400, "starting_after"),
        ("PUT", "/v1/responses/{id}", None, 405, None),
        ("GET", "/v1/responses/{id}/cancel", None, 404, None),
        ("GET", "/v1/conversations", None, 405, None),
        ("POST", "/v1/conversations", {"items": [{"type": "web_search_call"}]}, 400, "items"),
        ("POST", "/v1/conversations", {"metadata": {"k": "v" * 513}}, 400, "metadata"),
        ("POST", "/v1/conversations", {"title": "x"}, 400, "title"),
        ("POST", "/v1/conversations/conv_nope/items", {"items": []}, 400, "items"),
        ("GET", "/v1/conversations/conv_nope/items", None, 404, None),
    ],
)
async def test_what_the_store_routes_cannot_honour_is_named(
    stacks: MakeStack,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    status: int,
    param: str | None,
) -> None:
    stack = await stacks()
    async with httpx.AsyncClient(base_url=stack.url) as http:
        made = await http.post("/v1/responses", json={"model": "echo", "input": "hi"})
        r = await http.request(method, path.format(id=made.json()["id"]), json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


async def test_a_store_that_is_off_refuses_what_needs_it(stacks: MakeStack) -> None:
    stack = await stacks(response_store="off")
    api = client(stack)
    plain = await api.responses.create(model="echo", input="hi")  # store left out: fine
    assert plain.store is False
    async with httpx.AsyncClient(base_url=stack.url) as http:
        for field, value in (("store", True), ("previous_response_id", plain.id),
                             ("conversation", "conv_1")):  # fmt: skip
            r = await http.post("/v1/responses", json={"model": "echo", "input": "hi",
                                                       field: value})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(plain.id)
    await api.close()


class CountingEcho(WholePromptEcho):
    """Counts the requests it served."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.served = 0

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        self.served += 1
        async for out in super().generate(request, ctx):
            yield out


async def test_a_chained_turn_goes_where_its_chain_went(
    stacks: MakeStack, gguf_path: str
) -> None:
    """Round-robin with session affinity, three workers: a chain's turns carry its root's id
    as their session, so all three land on one worker; unchained ones go round."""
    engines = [CountingEcho(gguf_path) for _ in range(3)]
    stack = await stacks(engines[0], router_session_affinity_ttl_s=60.0)
    for engine in engines[1:]:
        await stack.add_worker(engine, model_name="echo")
    await stack.wait_for_model("echo", instances=3)
    api = client(stack)

    def served() -> list[int]:
        return [e.served for e in engines]

    previous = None
    for turn in range(3):
        out = await api.responses.create(model="echo", input=f"turn {turn}",
                                         previous_response_id=previous)  # fmt: skip
        previous = out.id
    assert sorted(served()) == [0, 0, 3], served()
    start = served()
    for _ in range(3):
        await api.responses.create(model="echo", input="alone", store=False)
    assert [b - a for a, b in zip(start, served(), strict=True)] == [1, 1, 1]
    await api.close()


async def test_openai_agents_responses_model_chains_by_itself(gguf_path: str) -> None:
    """openai-agents' Responses model with ``auto_previous_response_id``: each turn after the
    first sends only the tool's output and the previous response's id; the scripted model
    answers only when the whole conversation reached it, rebuilt from the store."""
    import agents
    from tests.frontend.test_agent_frameworks import WEATHER, get_weather

    before = set(asyncio.all_tasks())
    stack = await make_stack()
    engine = ScriptedToolEngine(gguf_path)
    await stack.add_worker(engine, model_name="agent", tool_call_parser="hermes")
    await stack.wait_for_model("agent")
    agents.set_tracing_disabled(True)
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        model=agents.OpenAIResponsesModel(model="agent", openai_client=api),
        tools=[agents.function_tool(get_weather)],
    )
    try:
        result = await agents.Runner.run(
            agent, "Weather in Paris, then Rome?", auto_previous_response_id=True
        )
        assert result.final_output == final_answer([WEATHER[c] for c in CITIES])
        assert len(engine.prompts) == 3 and all("MISSED" not in p for p in engine.prompts)
        assert "Weather in Paris, then Rome?" in engine.prompts[2]
    finally:
        await api.close()
        await stack.close()
    await assert_no_leaked_tasks(before)
