"""ApproxIndexer against a reference model: predictions live ttl_s after their last routing."""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from turnout.errors import ConfigError
from turnout.protocols.kv import AllBlocksCleared, KvCacheEvent
from turnout.router.kv.approx import ApproxIndexer
from turnout.router.kv.base import EventOutcome, WorkerKey

WORKERS = [WorkerKey(w, r) for w in range(3) for r in range(2)]


def chain(path: list[int]) -> list[int]:
    """Sequence hashes of a path of blocks: one distinct value per prefix, as in a prompt."""
    return [xxhash.xxh3_64_intdigest(repr(path[: i + 1]).encode()) for i in range(len(path))]


# Requests are paths over a small alphabet of blocks, so prefixes are shared.
HASH_LISTS = st.lists(st.integers(min_value=0, max_value=2), max_size=8).map(chain)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("route"), st.sampled_from(WORKERS), HASH_LISTS),
        # A wait carries its length in seconds as the one list item.
        st.tuples(
            st.just("wait"),
            st.sampled_from(WORKERS),
            st.sampled_from([0, 1, 4, 10, 25]).map(lambda s: [s]),
        ),
        st.tuples(st.just("drop_worker"), st.sampled_from(WORKERS), st.just([])),
        st.tuples(st.just("query"), st.sampled_from(WORKERS), HASH_LISTS),
    ),
    max_size=40,
)
TTL = 10.0


def reference(
    deadlines: dict[WorkerKey, dict[int, float]], seq: list[int], now: float
) -> dict[WorkerKey, int]:
    out: dict[WorkerKey, int] = {}
    for key, held in deadlines.items():
        depth = 0
        for h in seq:
            if held.get(h, now) <= now:
                break
            depth += 1
        if depth:
            out[key] = depth
    return out


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_find_matches_agrees_with_reference(ops: list[tuple[str, WorkerKey, list[int]]]) -> None:
    index = ApproxIndexer(ttl_s=TTL)
    deadlines: dict[WorkerKey, dict[int, float]] = {}
    now = 100.0
    for op, key, hashes in ops:
        if op == "route":
            index.record_routed(key, hashes, now)
            deadlines.setdefault(key, {}).update(dict.fromkeys(hashes, now + TTL))
        elif op == "wait":
            now += hashes[0]
        elif op == "drop_worker":
            index.remove_worker(key.worker_id)
            for k in [k for k in deadlines if k.worker_id == key.worker_id]:
                del deadlines[k]
        else:
            index.expire(now)
            assert index.find_matches(hashes).scores == reference(deadlines, hashes, now)
            live = sum(sum(1 for d in held.values() if d > now) for held in deadlines.values())
            assert index.num_blocks == live


def test_prediction_expires_after_ttl_and_refresh_extends_it() -> None:
    w = WorkerKey(1)
    index = ApproxIndexer(ttl_s=120.0)
    index.record_routed(w, [1, 2, 3], now=0.0)
    index.record_routed(w, [1, 2], now=60.0)  # the prefix was routed again
    assert index.expire(119.0) == 0
    assert index.expire(120.0) == 1  # block 3, last routed at 0
    assert index.find_matches([1, 2, 3]).scores == {w: 2}
    assert index.expire(180.0) == 2
    assert index.find_matches([1, 2, 3]).scores == {}
    assert index.num_expired == 3


def test_events_are_ignored_and_bad_ttl_rejected() -> None:
    index = ApproxIndexer()
    event = KvCacheEvent(worker_id=1, event_id=0, data=AllBlocksCleared())
    assert index.apply_event(event) is EventOutcome.IGNORED
    assert index.ttl_s == 120.0
    with pytest.raises(ConfigError):
        ApproxIndexer(ttl_s=0)
