"""The KV router's candidate list follows the live set without being rebuilt per request."""

from __future__ import annotations

from tests.router.kv.members import ENDPOINT, Members

from turnout.frontend.models.accepted_instances import AcceptedInstances
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.router import KvRouter
from turnout.runtime.event_plane.local import LocalEventPlane


def router_over(client: object, dp_size: int = 1) -> KvRouter:
    return KvRouter(
        KvRouterConfig(block_size=4),
        client,  # type: ignore[arg-type]
        LocalEventPlane(),
        ENDPOINT,
        dp_size=dp_size,
        share_active=False,
    )


def test_candidates_are_reused_until_the_live_set_changes() -> None:
    members = Members([1, 2])
    router = router_over(members, dp_size=2)
    first = router.candidates()
    assert list(first) == [WorkerKey(1, 0), WorkerKey(1, 1), WorkerKey(2, 0), WorkerKey(2, 1)]
    assert router.candidates() is first
    members.set_live([2, 5])
    assert list(router.candidates()) == [
        WorkerKey(2, 0), WorkerKey(2, 1), WorkerKey(5, 0), WorkerKey(5, 1),
    ]  # fmt: skip
    assert [k.worker_id for k in router.candidates(excluded=[2])] == [5, 5]
    assert [k.worker_id for k in router.candidates(allowed={2})] == [2, 2]
    assert list(router.candidates()) == [
        WorkerKey(2, 0), WorkerKey(2, 1), WorkerKey(5, 0), WorkerKey(5, 1),
    ]  # fmt: skip


def test_a_card_view_follows_both_the_live_set_and_its_accepted_instances() -> None:
    members = Members([1, 2, 3])
    view = AcceptedInstances(members)  # type: ignore[arg-type]
    assert view.instance_ids() == ()
    view.accepted = {1, 3}
    ids = view.instance_ids()
    assert ids == (1, 3)
    assert view.instance_ids() is ids
    members.set_live([2, 3])
    assert view.instance_ids() == (3,)
    view.accepted = {2, 3}
    assert view.instance_ids() == (2, 3)
    router = router_over(view)
    assert [k.worker_id for k in router.candidates()] == [2, 3]
    view.accepted = {2}
    assert [k.worker_id for k in router.candidates()] == [2]
