"""The response store's backends, one contract: memory, SQLite, and real PostgreSQL and Redis
servers. Records come back by tenant and id until they expire (an injected clock for the
backends that filter by it; Redis expires by its own clock, so by a short real expiry there),
a chain's touch moves its ancestors' expiry, conversation items keep their order, and two
store objects on one database see each other's writes (two frontends). Then the history above
them: a chain's expiry under an injected clock, a store that does not answer, and the items
input becomes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from turnout.errors import RequestError
from turnout.frontend.http.errors import HttpError
from turnout.frontend.responses.history import ResponseHistory, to_items
from turnout.frontend.responses.request import ResponsesRequest
from turnout.frontend.responses.store import (
    MemoryResponseStore,
    ResponseStore,
    make_response_store,
)
from turnout.frontend.responses.store.sqlite import SqliteResponseStore


class Clock:
    """A wall clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


BACKENDS = ["memory", "sqlite", "postgres", "redis"]


@pytest.fixture
async def spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The ``--response-store`` value of the backend under test (a fresh database)."""
    kind = request.param
    if kind == "memory":
        return "memory:"
    if kind == "sqlite":
        return f"sqlite:{tmp_path / 'responses.db'}"
    if kind == "postgres":
        return await request.getfixturevalue("postgres_server").create_database()
    server = request.getfixturevalue("redis_server")
    db = BACKENDS.index("redis") + len(request.node.name) % 8  # spread tests over dbs
    import redis.asyncio as aioredis

    client = aioredis.from_url(server.url(db))
    await client.flushdb()
    await client.aclose()
    return str(server.url(db))


@pytest.fixture
async def opened(spec: str) -> AsyncIterator[Callable[[Callable[[], float]], ResponseStore]]:
    """Opens stores of ``spec`` with a given clock; closes them all afterwards."""
    stores: list[ResponseStore] = []

    async def open_store(clock: Callable[[], float] = time.time) -> ResponseStore:
        store = make_response_store(spec, clock)
        assert store is not None
        await store.open()
        stores.append(store)
        return store

    yield open_store  # type: ignore[misc]
    for store in stores:
        await store.close()


def _expires_by_clock(spec: str) -> bool:
    return not spec.startswith("redis")


@pytest.mark.parametrize("spec", BACKENDS, indirect=True)
async def test_responses_by_tenant_and_id(spec: str, opened: Callable) -> None:
    store = await opened()
    later = time.time() + 3600
    await store.put_response("", "resp_a", b'{"a":1}', later)
    await store.put_response("t2", "resp_a", b"other tenant", later)
    assert await store.get_responses("", ["resp_a", "resp_missing"]) == {"resp_a": b'{"a":1}'}
    assert await store.get_responses("t2", ["resp_a"]) == {"resp_a": b"other tenant"}
    assert await store.get_responses("", []) == {}
    assert await store.delete_response("", "resp_a")
    assert not await store.delete_response("", "resp_a")
    assert await store.get_responses("", ["resp_a"]) == {}
    assert await store.get_responses("t2", ["resp_a"]) == {"resp_a": b"other tenant"}


@pytest.mark.parametrize("spec", BACKENDS, indirect=True)
async def test_expiry_and_a_chains_touch(spec: str, opened: Callable) -> None:
    if not _expires_by_clock(spec):  # Redis drops what expired by itself: poll for it
        store = await opened()
        now = time.time()
        await store.put_response("", "resp_root", b"root", now + 0.3)
        await store.put_response("", "resp_alone", b"alone", now + 0.3)
        await store.put_response("", "resp_next", b"next", now + 30, touch=["resp_root"])
        ids = ["resp_root", "resp_next", "resp_alone"]
        deadline = time.monotonic() + 10
        while "resp_alone" in (live := await store.get_responses("", ids)):
            assert time.monotonic() < deadline, "resp_alone did not expire"
            await asyncio.sleep(0.05)
        assert set(live) == {"resp_root", "resp_next"}  # the touched root lives on
        return
    clock = Clock()
    store = await opened(clock)
    await store.put_response("", "resp_root", b"root", clock.now + 10)
    await store.put_response("", "resp_alone", b"alone", clock.now + 10)
    await store.put_response("", "resp_next", b"next", clock.now + 100, touch=["resp_root"])
    clock.now += 50
    live = await store.get_responses("", ["resp_root", "resp_next", "resp_alone"])
    assert set(live) == {"resp_root", "resp_next"}
    assert await store.sweep() == 1
    assert not await store.delete_response("", "resp_alone")
    clock.now += 60
    assert await store.get_responses("", ["resp_root", "resp_next"]) == {}
    assert await store.sweep() == 2


@pytest.mark.parametrize("spec", BACKENDS, indirect=True)
async def test_conversation_items_keep_their_order(spec: str, opened: Callable) -> None:
    store = await opened()
    later = time.time() + 3600
    assert not await store.add_items("", "conv_x", [("i0", b"0")], later)  # no such one
    await store.put_conversation("", "conv_x", b"meta", later)
    assert await store.get_conversation("", "conv_x") == b"meta"
    assert await store.add_items("", "conv_x", [("i1", b"1"), ("i2", b"2")], later)
    assert await store.add_items("", "conv_x", [("i3", b"3")], later)
    assert await store.list_items("", "conv_x") == [("i1", b"1"), ("i2", b"2"), ("i3", b"3")]
    assert await store.delete_item("", "conv_x", "i2")
    assert not await store.delete_item("", "conv_x", "i2")
    await store.put_conversation("", "conv_x", b"meta2", later)  # items untouched
    assert await store.list_items("", "conv_x") == [("i1", b"1"), ("i3", b"3")]
    assert await store.list_items("other", "conv_x") == []
    assert await store.delete_conversation("", "conv_x")
    assert not await store.delete_conversation("", "conv_x")
    assert await store.get_conversation("", "conv_x") is None
    assert await store.list_items("", "conv_x") == []
    # A conversation made again under the same id starts empty.
    await store.put_conversation("", "conv_x", b"meta", later)
    assert await store.list_items("", "conv_x") == []


@pytest.mark.parametrize("spec", [b for b in BACKENDS if b != "redis"], indirect=True)
async def test_expired_conversations_go_with_their_items(spec: str, opened: Callable) -> None:
    clock = Clock()
    store = await opened(clock)
    await store.put_conversation("", "conv_old", b"old", clock.now + 10)
    await store.add_items("", "conv_old", [("i1", b"1")], clock.now + 10)
    await store.put_conversation("", "conv_new", b"new", clock.now + 10)
    await store.add_items("", "conv_new", [("i1", b"1")], clock.now + 100)  # moves its expiry
    clock.now += 50
    assert await store.get_conversation("", "conv_old") is None
    assert await store.list_items("", "conv_old") == []
    assert not await store.delete_item("", "conv_old", "i1")
    assert await store.list_items("", "conv_new") == [("i1", b"1")]
    assert await store.sweep() == 1
    clock.now -= 50  # even with time turned back, the swept conversation is gone
    assert await store.get_conversation("", "conv_old") is None


@pytest.mark.parametrize("spec", ["sqlite", "postgres", "redis"], indirect=True)
async def test_two_stores_on_one_database_see_each_other(spec: str, opened: Callable) -> None:
    """What two frontends on one ``--response-store`` rely on."""
    first, second = await opened(), await opened()
    later = time.time() + 3600
    await first.put_response("", "resp_1", b"one", later)
    assert await second.get_responses("", ["resp_1"]) == {"resp_1": b"one"}
    await second.put_conversation("", "conv_1", b"c", later)
    await first.add_items("", "conv_1", [("a", b"a")], later)
    await second.add_items("", "conv_1", [("b", b"b")], later)
    assert await first.list_items("", "conv_1") == [("a", b"a"), ("b", b"b")]
    assert await second.delete_response("", "resp_1")
    assert await first.get_responses("", ["resp_1"]) == {}


async def test_the_sqlite_file_is_private_and_in_wal_mode(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "sub" / "responses.db"
    store = SqliteResponseStore(str(path))
    await store.open()
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        with sqlite3.connect(path) as db:
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        await store.close()


def test_the_store_is_named_by_the_flag(tmp_path: Path) -> None:
    from turnout.errors import ConfigError
    from turnout.frontend.responses.store import default_sqlite_path

    assert make_response_store("off") is None
    default = make_response_store("sqlite:")
    assert isinstance(default, SqliteResponseStore) and default.path == default_sqlite_path()
    named = make_response_store(f"sqlite:{tmp_path}/r.db")
    assert isinstance(named, SqliteResponseStore) and named.path == f"{tmp_path}/r.db"
    pg = make_response_store("postgres://u:secret@h/db")
    assert pg is not None and "secret" not in pg.description
    with pytest.raises(ConfigError, match="--response-store"):
        make_response_store("mysql://h/db")


# ---------------------------------------------------------------------- the history above them


class HangingStore(MemoryResponseStore):
    """A store that never answers (a database frozen mid-call)."""

    async def get_responses(self, tenant: str, response_ids: Sequence[str]) -> dict[str, bytes]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def put_response(self, *args: Any, **kwargs: Any) -> None:
        await asyncio.Event().wait()


def _request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest(model="m", **{"input": "hi", **fields})


async def _turn(history: ResponseHistory, text: str, previous: str | None = None) -> str:
    turn = await history.begin(_request(input=text, previous_response_id=previous), "")
    body = {"id": turn.response_id, "status": "completed",
            "output": [{"type": "message", "id": "msg_o", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": f"re: {text}",
                                     "annotations": []}]}]}  # fmt: skip
    kept = await history.keep(turn, body)
    assert kept["store"] is True
    return turn.response_id


async def test_a_chain_lives_as_long_as_its_last_turn() -> None:
    clock = Clock()
    history = ResponseHistory(MemoryResponseStore(clock), ttl=100, clock=clock)
    first = await _turn(history, "one")
    clock.now += 60
    second = await _turn(history, "two", first)  # moves the first turn's expiry too
    clock.now += 60  # the first turn's own expiry has passed
    turn = await history.begin(_request(input="three", previous_response_id=second), "")
    said = [p["text"] for item in turn.context for p in item["content"]]
    assert said == ["one", "re: one", "two", "re: two"]
    assert turn.session_id == first and turn.ancestors == [first, second]
    clock.now += 101  # nothing written since: the whole chain is gone
    with pytest.raises(HttpError) as gone:
        await history.begin(_request(previous_response_id=second), "")
    assert gone.value.status == 404 and gone.value.param == "previous_response_id"


async def test_a_store_that_does_not_answer_is_a_503_and_answers_go_unstored() -> None:
    history = ResponseHistory(HangingStore(), deadline=0.05)
    with pytest.raises(HttpError) as caught:
        await history.begin(_request(previous_response_id="resp_x"), "")
    assert caught.value.status == 503 and caught.value.code == "response_store_unavailable"
    turn = await history.begin(_request(), "")  # a first turn reads nothing
    kept = await history.keep(turn, {"id": turn.response_id, "output": []})
    assert kept["store"] is False


def test_input_becomes_items_the_client_reads_back() -> None:
    from openai.types.responses import ResponseItem
    from pydantic import TypeAdapter

    items = to_items(
        [
            {"role": "user", "content": "hi"},
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "rules"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
            {"type": "reasoning", "summary": []},
        ],
        "input",
    )  # fmt: skip
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseItem)
    for item in items:
        adapter.validate_python(item, strict=True)
    assert len({item["id"] for item in items}) == len(items)
    with pytest.raises(RequestError) as caught:
        to_items([{"type": "computer_call"}], "items")
    assert caught.value.param == "items"
