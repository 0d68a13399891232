"""ActiveSequences: maintained counters equal a recomputation; replicas mirror via events."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnout.errors import ConfigError
from turnout.router.kv.active_sequences import (
    ActiveLoad,
    ActiveSequenceEvent,
    ActiveSequenceEventKind,
    ActiveSequences,
    RequestPhase,
)
from turnout.router.kv.base import WorkerKey

BS = 16
TTL = 50.0
WORKERS = [WorkerKey(w, r) for w in range(3) for r in range(2)]
REQUEST_IDS = [f"r{i}" for i in range(8)]


@dataclass
class RefRequest:
    worker: WorkerKey
    prompt: int
    overlap: int
    prefilling: bool
    touched: float


def recompute(requests: dict[str, RefRequest], key: WorkerKey) -> ActiveLoad:
    mine = [r for r in requests.values() if r.worker == key]
    return ActiveLoad(
        sum(max(r.prompt - r.overlap * BS, 0) for r in mine if r.prefilling),
        sum(-(-r.prompt // BS) for r in mine),
        len(mine),
    )


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.sampled_from(REQUEST_IDS),
            st.sampled_from(WORKERS),
            st.integers(0, 300),
            st.integers(0, 25),
        ),
        st.tuples(st.just("prefill_done"), st.sampled_from(REQUEST_IDS), *[st.just(0)] * 3),
        st.tuples(st.just("free"), st.sampled_from(REQUEST_IDS), *[st.just(0)] * 3),
        st.tuples(
            st.just("wait"), st.just(""), st.just(0), st.sampled_from([1, 20, 60]), st.just(0)
        ),
        st.tuples(st.just("drop_worker"), st.just(""), st.sampled_from(WORKERS), *[st.just(0)] * 2),
    ),
    max_size=50,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_counters_equal_recomputation_and_replica_mirrors(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    events: list[ActiveSequenceEvent] = []
    active = ActiveSequences(block_size=BS, ttl_s=TTL, router_id="a", publish=events.append)
    replica = ActiveSequences(block_size=BS, ttl_s=TTL, router_id="b")
    requests: dict[str, RefRequest] = {}
    now = 0.0
    for op, request_id, key, size, overlap in ops:
        if op == "add":
            active.add_request(
                request_id, key, num_prompt_tokens=size, overlap_blocks=overlap, now=now
            )
            requests[request_id] = RefRequest(key, size, overlap, True, now)
        elif op == "prefill_done":
            ref = requests.get(request_id)
            assert active.mark_prefill_done(request_id, now) == (ref is not None and ref.prefilling)
            if ref is not None and ref.prefilling:
                ref.prefilling = False
                ref.touched = now
        elif op == "free":
            assert active.free(request_id) == (request_id in requests)
            requests.pop(request_id, None)
        elif op == "wait":
            now += size
            expired = [rid for rid, r in requests.items() if r.touched + TTL <= now]
            assert active.expire(now) == len(expired)
            replica.expire(now)
            for rid in expired:
                del requests[rid]
        else:
            gone = [rid for rid, r in requests.items() if r.worker.worker_id == key.worker_id]
            assert active.remove_worker(key.worker_id) == len(gone)
            replica.remove_worker(key.worker_id)
            for rid in gone:
                del requests[rid]
        # The replica sees the published events (through a msgpack round trip).
        for event in events:
            wire = msgspec.msgpack.encode(event)
            replica.apply_event(msgspec.msgpack.decode(wire, type=ActiveSequenceEvent), now)
        events.clear()
        for worker in WORKERS:
            expected = recompute(requests, worker)
            assert active.get_load(worker) == expected
            assert replica.get_load(worker) == expected
        assert len(active) == len(requests) == len(replica)


def test_lifecycle_and_counters() -> None:
    w = WorkerKey(1)
    active = ActiveSequences(block_size=16)
    active.add_request("a", w, num_prompt_tokens=100, overlap_blocks=2, now=0.0)
    # 100 - 2*16 = 68 tokens to prefill; ceil(100/16) = 7 blocks held.
    assert active.get_load(w) == ActiveLoad(68, 7, 1)
    assert active.get_phase("a") is RequestPhase.PREFILL
    assert active.mark_prefill_done("a")
    assert not active.mark_prefill_done("a")  # already done: idempotent
    assert active.get_load(w) == ActiveLoad(0, 7, 1)
    assert active.get_phase("a") is RequestPhase.DECODE
    assert active.free("a")
    assert not active.free("a")
    assert active.get_load(w) == ActiveLoad(0, 0, 0)
    assert active.get_phase("a") is RequestPhase.GONE
    assert active.get_workers() == []


def test_re_adding_a_request_moves_it() -> None:
    a, b = WorkerKey(1), WorkerKey(2)
    active = ActiveSequences(block_size=16)
    active.add_request("r", a, num_prompt_tokens=32, overlap_blocks=0, now=0.0)
    active.add_request("r", b, num_prompt_tokens=32, overlap_blocks=1, now=1.0)  # migrated
    assert active.get_load(a) == ActiveLoad(0, 0, 0)
    assert active.get_load(b) == ActiveLoad(16, 2, 1)
    assert active.get_worker_key("r") == b


def test_expiry_counts_from_last_transition() -> None:
    w = WorkerKey(1)
    active = ActiveSequences(block_size=16, ttl_s=10.0)
    active.add_request("r", w, num_prompt_tokens=16, overlap_blocks=0, now=0.0)
    active.mark_prefill_done("r", now=8.0)
    assert active.expire(12.0) == 0
    assert active.expire(18.0) == 1
    assert "r" not in active
    assert active.num_expired == 1


def test_own_events_are_ignored_and_unknown_ids_are_harmless() -> None:
    active = ActiveSequences(block_size=16, router_id="me")
    own = ActiveSequenceEvent(
        kind=ActiveSequenceEventKind.ADDED,
        request_id="x",
        router_id="me",
        worker_key=WorkerKey(1),
        prefill_tokens=5,
        num_blocks=1,
    )
    assert not active.apply_event(own, now=0.0)
    freed = msgspec.structs.replace(own, kind=ActiveSequenceEventKind.FREED, router_id="other")
    assert not active.apply_event(freed, now=0.0)
    assert len(active) == 0


def test_heap_stays_bounded_under_churn() -> None:
    active = ActiveSequences(block_size=16)
    for i in range(5000):
        active.add_request(str(i), WorkerKey(1), num_prompt_tokens=16, overlap_blocks=0, now=i)
        active.free(str(i))
    assert len(active._deadlines) <= 4 * len(active) + 1025


@pytest.mark.parametrize(("block_size", "ttl"), [(0, 1.0), (16, 0.0)])
def test_bad_settings_rejected(block_size: int, ttl: float) -> None:
    with pytest.raises(ConfigError):
        ActiveSequences(block_size=block_size, ttl_s=ttl)


def test_bad_sizes_rejected() -> None:
    active = ActiveSequences(block_size=16)
    with pytest.raises(ValueError, match="bad request sizes"):
        active.add_request("r", WorkerKey(1), num_prompt_tokens=-1, overlap_blocks=0, now=0.0)
