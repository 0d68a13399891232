"""The load-based router modes (power-of-two, least-loaded, device-aware-weighted), the
in-flight counts they read: statistics under fixed seeds."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Sequence

import pytest

from turnout.errors import ConfigError, PeerUnavailable, StreamBroken
from turnout.router.instance_load import InstanceLoad
from turnout.router.load_selectors import (
    DeviceAwareSelector,
    LeastLoadedSelector,
    PowerOfTwoSelector,
)
from turnout.router.mode import RouterMode
from turnout.router.push_router import PushRouter
from turnout.router.selectors import RoundRobinSelector, make_selector
from turnout.runtime.context import RequestContext

N = 20_000


def loaded(counts: dict[int, int]) -> InstanceLoad:
    load = InstanceLoad()
    for instance_id, n in counts.items():
        for _ in range(n):
            load.on_stream_started(instance_id)
    return load


# -- in-flight counts -----------------------------------------------------------------------


def test_counts_go_up_and_back_to_zero_and_entries_are_dropped() -> None:
    load = InstanceLoad()
    a = load.on_stream_started(1)
    b = load.on_stream_started(1)
    load.on_stream_started(2)
    assert load.snapshot() == {1: 2, 2: 1}
    assert load.total([1, 2, 3]) == 3
    load.on_stream_ended(a)
    load.on_stream_ended(b)
    assert load.in_flight(1) == 0
    assert load.snapshot() == {2: 1}  # no entry kept for an idle instance


def test_an_instance_that_leaves_is_forgotten_and_its_late_streams_do_not_count() -> None:
    load = InstanceLoad()
    old = load.on_stream_started(7)
    load.on_stream_started(8)
    load.retain({8})
    assert load.snapshot() == {8: 1}
    new = load.on_stream_started(7)  # it came back under the same id
    load.on_stream_ended(old)  # a stream of its former life ends late
    assert load.in_flight(7) == 1
    load.on_stream_ended(new)
    assert load.in_flight(7) == 0


# -- power-of-two ---------------------------------------------------------------------------


def test_power_of_two_draws_two_distinct_and_takes_the_lighter() -> None:
    # Loads 0 < 1 < 2 < 3: the instance of rank r (0: lightest) wins when it is in the
    # drawn pair with a heavier one: (N-1-r) of the C(4,2) = 6 pairs.
    selector = PowerOfTwoSelector(loaded({10: 0, 11: 1, 12: 2, 13: 3}), seed=1)
    counts = Counter(selector.select([10, 11, 12, 13], None) for _ in range(N))
    for instance_id, expected in ((10, 3 / 6), (11, 2 / 6), (12, 1 / 6)):
        assert counts[instance_id] / N == pytest.approx(expected, abs=0.015)
    assert counts[13] == 0  # the heaviest never wins a distinct pair


def test_power_of_two_never_sends_to_a_loaded_instance_while_another_is_idle() -> None:
    selector = PowerOfTwoSelector(loaded({1: 50}), seed=2)
    counts = Counter(selector.select([1, 2, 3, 4, 5], None) for _ in range(N))
    assert counts[1] == 0
    for idle in (2, 3, 4, 5):  # ties go to the first draw: uniform over the idle ones
        assert counts[idle] / N == pytest.approx(1 / 4, abs=0.015)


def test_power_of_two_with_one_candidate_takes_it() -> None:
    assert PowerOfTwoSelector(loaded({9: 3}), seed=0).select([9], None) == 9


# -- least-loaded ---------------------------------------------------------------------------


def test_least_loaded_balances_exactly() -> None:
    load = InstanceLoad()
    selector = LeastLoadedSelector(load, seed=3)
    candidates = [1, 2, 3, 4]
    for _ in range(400):  # every request stays in flight
        load.on_stream_started(selector.select(candidates, None))
    assert load.snapshot() == {1: 100, 2: 100, 3: 100, 4: 100}


def test_least_loaded_breaks_ties_at_random() -> None:
    selector = LeastLoadedSelector(loaded({1: 2, 2: 0, 3: 0, 4: 0}), seed=4)
    counts = Counter(selector.select([1, 2, 3, 4], None) for _ in range(N))
    assert counts[1] == 0
    for instance_id in (2, 3, 4):
        assert counts[instance_id] / N == pytest.approx(1 / 3, abs=0.015)


# -- device-aware-weighted ------------------------------------------------------------------

GPUS, CPUS = [1, 2], [11, 12, 13, 14]
DEVICES = {**{g: "gpu" for g in GPUS}, **{c: "cpu" for c in CPUS}}


@pytest.mark.parametrize("ratio", [1, 2, 8])
def test_device_aware_keeps_cpu_in_flight_under_its_budget(ratio: int) -> None:
    load = InstanceLoad()
    selector = DeviceAwareSelector(load, lambda: DEVICES, ratio=ratio, seed=5)
    candidates = GPUS + CPUS
    for _ in range(2000):
        gpu, cpu = load.total(GPUS), load.total(CPUS)
        allowed = gpu * len(CPUS) // (ratio * len(GPUS))
        choice = selector.select(candidates, None)
        assert (choice in CPUS) == (cpu < allowed), (gpu, cpu, allowed, choice)
        load.on_stream_started(choice)
    gpu, cpu = load.total(GPUS), load.total(CPUS)
    # The CPU group ends at its budget, within one request.
    assert cpu <= gpu * len(CPUS) // (ratio * len(GPUS)) + 1
    assert cpu >= gpu * len(CPUS) // (ratio * len(GPUS)) - 1
    # Least-loaded within each group.
    for group in (GPUS, CPUS):
        counts = [load.in_flight(i) for i in group]
        assert max(counts) - min(counts) <= 1


def test_device_aware_with_one_group_is_least_loaded() -> None:
    for devices in ({1: "cpu", 2: "cpu"}, {1: "gpu", 2: "gpu"}, {}):
        load = InstanceLoad()
        selector = DeviceAwareSelector(load, lambda d=devices: d, seed=6)  # type: ignore[misc]
        for _ in range(100):
            load.on_stream_started(selector.select([1, 2], None))
        assert load.snapshot() == {1: 50, 2: 50}


# -- start-up -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        (RouterMode.POWER_OF_TWO, PowerOfTwoSelector),
        (RouterMode.LEAST_LOADED, LeastLoadedSelector),
        (RouterMode.DEVICE_AWARE_WEIGHTED, DeviceAwareSelector),
    ],
)
def test_the_load_modes_are_built(mode: RouterMode, kind: type) -> None:
    load = InstanceLoad()
    selector = make_selector(mode, seed=0, load=load)
    assert isinstance(selector, kind)
    assert selector.load is load  # type: ignore[attr-defined]


def test_a_bad_ratio_fails_at_start_up() -> None:
    with pytest.raises(ConfigError, match="--router-cpu-gpu-ratio must be an integer >= 1"):
        make_selector(RouterMode.DEVICE_AWARE_WEIGHTED, cpu_gpu_ratio=0)


# -- the push router counts every way a stream ends -----------------------------------------


class FakeClient:
    """Instances whose streams yield ``tokens`` outputs, or fail as told; records opens."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)
        self.unreachable: set[int] = set()
        self.broken: set[int] = set()
        self.opened: list[int] = []

    def instance_ids(self) -> list[int]:
        return list(self.ids)

    async def stream(
        self, instance_id: int, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]:
        self.opened.append(instance_id)
        if instance_id in self.unreachable:
            raise PeerUnavailable(f"instance {instance_id} unreachable")
        for i in range(3):
            if instance_id in self.broken and i == 1:
                raise StreamBroken("connection lost")
            yield bytes([i])


def make_router(client: FakeClient) -> PushRouter[bytes, bytes]:
    return PushRouter(
        client, RoundRobinSelector(), encode=lambda b: b, decode=lambda b: b, max_attempts=3
    )


async def test_in_flight_returns_to_zero_however_a_stream_ends() -> None:
    client = FakeClient([1, 2])
    router = make_router(client)
    # Finished.
    stream = router.generate(b"x", RequestContext())
    assert await anext(stream) == b"\x00"
    assert router.load.snapshot() == {1: 1}
    assert [out async for out in stream] == [b"\x01", b"\x02"]
    assert router.load.snapshot() == {}
    # Cancelled: the client went away mid-stream.
    stream = router.generate(b"x", RequestContext())
    await anext(stream)
    assert router.load.snapshot() == {2: 1}
    await stream.aclose()  # type: ignore[attr-defined]
    assert router.load.snapshot() == {}
    # Failed mid-stream (migration above re-issues it; this attempt is over).
    client.broken.add(1)
    with pytest.raises(StreamBroken):
        async for _ in router.generate(b"x", RequestContext()):
            assert router.load.snapshot() == {1: 1}
    assert router.load.snapshot() == {}
    # Re-routed: the first instance is unreachable, the second serves it.
    client.broken.clear()
    client.unreachable.add(2)
    outs = [out async for out in router.generate(b"x", RequestContext())]
    assert client.opened[-2:] == [2, 1]
    assert len(outs) == 3
    assert router.load.snapshot() == {}
