"""KV router replicas over a real (local) event plane: one's in-flight requests reach the
others as batches (one publish per event-loop iteration), only while another replica hears
it; a replica that starts to listen gets a snapshot, and one that goes silent is forgotten
with its requests. The presence table itself on an injected clock."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from tests.polling import eventually
from tests.router.kv.members import ENDPOINT, Members

from turnout.router.kv.active_sequences import (
    ActiveSequenceBatch,
    ActiveSequenceEvent,
    ActiveSequenceEventKind,
    ActiveSequences,
)
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.replicas import ReplicaPeers, ReplicaPresence, is_presence
from turnout.router.kv.router import ACTIVE_BATCH_MAX, ACTIVE_TOPIC, KvRouter
from turnout.runtime.event_plane import EventSubscription
from turnout.runtime.event_plane.local import LocalEventPlane

INTERVAL = 0.05


def replica(plane: LocalEventPlane, name: str) -> KvRouter:
    return KvRouter(
        KvRouterConfig(block_size=4, use_kv_events=False),
        Members([1, 2]),  # type: ignore[arg-type]
        plane,
        ENDPOINT,
        router_id=name,
        presence_interval_s=INTERVAL,
    )


def loads(router: KvRouter) -> dict[WorkerKey, tuple[int, int]]:
    return {k: (c.num_requests, c.prefill_requests) for k, c in router.core.active.counters.items()}


class Tap:
    """Counts what replicas publish on the replica-sync topic, in its own task: change
    batches apart from presences."""

    def __init__(self, sub: EventSubscription) -> None:
        self.batches = 0
        self.presences = 0
        self.task = asyncio.create_task(self._run(sub))

    async def _run(self, sub: EventSubscription) -> None:
        async for event in sub:
            if is_presence(event.payload):
                self.presences += 1
            else:
                self.batches += 1

    async def settle(self) -> None:
        """Wait until a presence more than now arrived: the loop iterations in which earlier
        changes would have been published have run."""
        target = self.presences + 2
        await eventually(lambda: self.presences >= target, what="presences beat")


async def tap(plane: LocalEventPlane) -> Tap:
    return Tap(await plane.subscribe(ENDPOINT.namespace, ENDPOINT.component, ACTIVE_TOPIC))


async def heard(*replicas: KvRouter) -> None:
    for r in replicas:
        await eventually(lambda r=r: r.peers.listening, what=f"a replica hears {r.router_id}")


async def test_replicas_converge_with_one_publish_per_loop_iteration() -> None:
    plane = LocalEventPlane()
    one, two = replica(plane, "one"), replica(plane, "two")
    await one.start()
    await two.start()
    try:
        await heard(one, two)
        taps = await tap(plane)
        n = 40
        for i in range(n):  # adds, first tokens and frees within one loop iteration
            one.route(f"r{i}", list(range(16)))
        for i in range(n // 2):
            one.on_first_token(f"r{i}")
        for i in range(n // 4):
            one.on_finished(f"r{i}")
        await eventually(lambda: loads(two) == loads(one), what="replica two converges")
        assert sum(r for r, _ in loads(two).values()) == n - n // 4
        await taps.settle()
        assert taps.batches == 1  # not one per change (90 here)
        # A later iteration's changes go in a batch of their own, applied after the first.
        for i in range(n // 4, n):
            one.on_finished(f"r{i}")
        await eventually(lambda: not loads(two), what="replica two sees every request freed")
        await taps.settle()
        assert taps.batches == 2
    finally:
        await one.close()
        await two.close()


async def test_a_burst_beyond_the_bound_is_split() -> None:
    plane = LocalEventPlane()
    one, two = replica(plane, "one"), replica(plane, "two")
    await one.start()
    await two.start()
    try:
        await heard(one)
        taps = await tap(plane)
        n = ACTIVE_BATCH_MAX + 10
        for i in range(n):
            one.route(f"r{i}", [i])
        await eventually(lambda: loads(two) == loads(one), what="replica two converges")
        await taps.settle()
        assert taps.batches == 2
    finally:
        await one.close()
        await two.close()


async def test_silent_alone_then_a_snapshot_for_a_peer_and_silent_again_when_it_leaves() -> None:
    plane = LocalEventPlane()
    taps = await tap(plane)
    one = replica(plane, "one")
    await one.start()
    two = replica(plane, "two")
    try:
        for i in range(6):
            one.route(f"r{i}", list(range(8)))
        one.on_first_token("r0")
        one.on_finished("r5")
        await taps.settle()
        assert taps.batches == 0  # nobody hears it: no change was sent

        await two.start()  # joins late: it learns one's requests from a snapshot
        await eventually(lambda: loads(two) == loads(one), what="replica two gets the snapshot")
        assert sum(n for n, _ in loads(two).values()) == 5  # r0..r4
        assert sum(p for _, p in loads(two).values()) == 4  # r0 is decoding there too
        two.route("t0", list(range(8)))  # and changes flow both ways
        one.on_finished("r1")
        await eventually(lambda: loads(two) == loads(one), what="replicas converge")

        await two.close()  # it leaves: one forgets it and its request, and is silent again
        await eventually(lambda: "two" not in one.peers, what="replica two forgotten")
        assert not one.peers.listening
        assert sum(n for n, _ in loads(one).values()) == 4  # r0, r2, r3, r4; t0 forgotten
        await taps.settle()
        before = taps.batches
        one.on_finished("r2")
        await taps.settle()
        assert taps.batches == before
    finally:
        await one.close()
        await two.close()


async def test_a_replica_without_presences_is_published_to() -> None:
    """A replica of a version without presences (a rolling upgrade) publishes its changes and
    hears everything: its batches make it a listening peer, so this replica's changes reach
    it; when it falls silent it leaves the table, but its requests stay (to their TTL)."""
    plane = LocalEventPlane()
    taps = await tap(plane)
    one = replica(plane, "one")
    await one.start()
    old = await plane.publisher(ENDPOINT.namespace, ENDPOINT.component)
    try:
        added = ActiveSequenceEvent(
            kind=ActiveSequenceEventKind.ADDED, request_id="o1", router_id="old",
            worker_key=WorkerKey(1, 0), prefill_tokens=8, num_blocks=2,
        )  # fmt: skip
        old.publish_nowait(ACTIVE_TOPIC, msgspec.msgpack.encode(ActiveSequenceBatch([added])))
        await eventually(lambda: one.peers.listening, what="the old replica counts as a peer")
        assert loads(one) == {WorkerKey(1, 0): (1, 1)}
        before = taps.batches
        one.route("r0", list(range(8)))
        await eventually(lambda: taps.batches > before, what="a batch for the old replica")
        await eventually(lambda: "old" not in one.peers, what="the silent old replica dropped")
        assert not one.peers.listening
        assert sum(n for n, _ in loads(one).values()) == 2  # o1 kept, and r0
    finally:
        await old.close()
        await one.close()


def presence(router_id: str, *hears: str) -> ReplicaPresence:
    return ReplicaPresence(router_id=router_id, hears=list(hears))


def test_peers_alive_listening_and_gone_on_the_clock() -> None:
    peers = ReplicaPeers("me", interval_s=2.0, max_peers=2)
    assert not peers.listening
    assert peers.on_presence(presence("a"), 0.0) == (True, False)  # new, does not hear me
    assert peers.on_presence(presence("a", "me"), 1.0) == (False, True)  # hears me now
    assert peers.on_presence(presence("a", "me"), 2.0) == (False, False)
    assert peers.listening
    assert peers.on_presence(presence("b", "me"), 2.0) == (True, True)
    assert peers.on_presence(presence("c", "me"), 2.0) == (False, False)  # past the bound
    assert peers.on_presence(presence("me"), 2.0) == (False, False)  # its own
    assert sorted(peers.ids()) == ["a", "b"]
    assert peers.expire(7.9) == []
    assert peers.expire(8.0) == ["a", "b"]  # three intervals without a presence
    assert not peers.listening and peers.ids() == []
    peers.on_presence(presence("a", "me"), 9.0)
    assert peers.on_presence(presence("a"), 10.0) == (False, False)  # stopped hearing me
    assert not peers.listening


def test_a_peer_known_by_its_batches_only() -> None:
    peers = ReplicaPeers("me", interval_s=2.0, max_peers=2)
    assert peers.on_batch("old", 0.0)  # a replica without presences: a listening peer
    assert peers.listening
    assert not peers.on_batch("old", 5.0)  # its batches keep it alive
    assert not peers.on_batch("me", 5.0)
    assert peers.expire(10.9) == []
    assert peers.expire(11.0) == []  # gone, but not reported: its requests stay
    assert not peers.listening and peers.ids() == []
    peers.on_batch("new", 12.0)
    peers.on_presence(presence("new"), 13.0)  # it speaks presences: judged by them alone
    assert not peers.listening
    assert not peers.on_batch("new", 14.0)
    assert peers.expire(19.0) == ["new"]


@pytest.mark.parametrize(
    ("message", "is_one"),
    [
        (ReplicaPresence(router_id="x"), True),
        (ReplicaPresence(router_id="x", hears=[str(i) for i in range(20)], to="y"), True),
        ([[]], False),  # an ActiveSequenceBatch is an array
    ],
)
def test_presences_and_batches_tell_apart_by_their_first_byte(
    message: object, is_one: bool
) -> None:
    assert is_presence(msgspec.msgpack.encode(message)) is is_one
    assert not is_presence(b"")


def test_a_snapshot_rebuilds_own_requests_and_a_gone_replica_is_dropped() -> None:
    a = ActiveSequences(block_size=4, router_id="a")
    b = ActiveSequences(block_size=4, router_id="b")
    a.add_request("x", WorkerKey(1), num_prompt_tokens=10, overlap_blocks=1, now=0.0)
    a.add_request("y", WorkerKey(2), num_prompt_tokens=4, overlap_blocks=0, now=0.0)
    a.mark_prefill_done("y")
    b.add_request("z", WorkerKey(1), num_prompt_tokens=4, overlap_blocks=0, now=0.0)
    for event in a.snapshot_events():
        b.apply_event(event, 0.0)
    for event in b.snapshot_events():
        a.apply_event(event, 0.0)
    for key in (WorkerKey(1), WorkerKey(2)):
        assert a.get_load(key) == b.get_load(key)
    assert [e.request_id for e in a.snapshot_events()] == ["x", "y", "y"]  # its own only
    assert b.remove_router("b") == 0  # never its own
    assert b.remove_router("a") == 2
    assert b.get_load(WorkerKey(1)) == (4, 1, 1) and b.get_load(WorkerKey(2)) == (0, 0, 0)
