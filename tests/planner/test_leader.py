"""The planners' leader election on a real in-process store: the first candidate leads, the
next takes over when it leaves or its lease ends, and a candidate that cannot hear from the
store for a TTL stops leading."""

from __future__ import annotations

from tests.polling import eventually

from turnout.planner.leader import Candidate, LeaderElection, candidates_prefix
from turnout.runtime.discovery.memory import MemoryStore

TTL = 0.3


async def test_first_candidate_leads_and_the_next_takes_over() -> None:
    store = MemoryStore()
    a = LeaderElection(store, "ns", Candidate(host="a", pid=1), ttl=TTL)
    b = LeaderElection(store, "ns", Candidate(host="b", pid=2), ttl=TTL)
    await a.start()
    await b.start()
    await a.poll()
    assert a.leading and not b.leading
    assert b.leader == Candidate(host="a", pid=1)
    assert await a.others() == 1
    await a.stop()
    await eventually(lambda: b.leading, what="b leads")
    assert b.leader == Candidate(host="b", pid=2)
    assert await b.others() == 0
    await b.stop()
    assert await store.get_prefix(candidates_prefix("ns")) == []


async def test_other_namespaces_elect_their_own_leader() -> None:
    store = MemoryStore()
    a = LeaderElection(store, "one", Candidate(host="a", pid=1), ttl=TTL)
    b = LeaderElection(store, "two", Candidate(host="b", pid=2), ttl=TTL)
    await a.start()
    await b.start()
    assert a.leading and b.leading
    await a.stop()
    await b.stop()


async def test_a_candidate_whose_lease_ended_stands_again_behind_the_others() -> None:
    store = MemoryStore()
    a = LeaderElection(store, "ns", Candidate(host="a", pid=1), ttl=TTL)
    b = LeaderElection(store, "ns", Candidate(host="b", pid=2), ttl=TTL)
    await a.start()
    await b.start()
    (first, _) = sorted(await store.get_prefix(candidates_prefix("ns")), key=lambda kv: kv.revision)
    assert first.lease_id is not None
    await store.revoke_lease(first.lease_id)  # the store ends the leader's lease
    await eventually(lambda: b.leading, what="b leads")
    # a stands again, under a new lease, at the back of the line.
    await eventually(lambda: len(store._kvs) == 2, what="a stands again")
    await a.poll()
    assert not a.leading and b.leading
    await a.stop()
    await b.stop()


async def test_a_leader_that_cannot_hear_from_the_store_for_a_ttl_stops_leading() -> None:
    now = [0.0]
    store = MemoryStore()
    a = LeaderElection(store, "ns", Candidate(host="a", pid=1), ttl=10.0, clock=lambda: now[0])
    await a.start()
    assert a.leading
    now[0] = 9.9
    assert a.leading
    now[0] = 10.0  # no answer read for a whole TTL: the others may have elected someone
    assert not a.leading
    await a.poll()
    assert a.leading
    await a.stop()
