"""Instance selection policies for the simple (not KV-aware) router modes.

A policy is one method, ``select(candidates, request) -> instance_id``; candidates are the live,
not-set-aside instance ids, never empty (the router handles "no instance" itself).
"""

from __future__ import annotations

import abc
import random
from collections.abc import Callable, Mapping, Sequence

from turnout.errors import ConfigError, NotYetSupported, RequestError
from turnout.protocols.llm import PreprocessedRequest
from turnout.router.instance_load import InstanceLoad
from turnout.router.mode import RouterMode


class InstanceSelector(abc.ABC):
    #: True when every request must name its instance (``direct``): the router then refuses
    #: an unpinned request as the client's error before looking at candidates.
    needs_pin = False

    @abc.abstractmethod
    def select(self, candidates: Sequence[int], request: PreprocessedRequest | None) -> int: ...


class RoundRobinSelector(InstanceSelector):
    """Cycles through candidates; robust to the candidate list changing between calls."""

    def __init__(self) -> None:
        self._counter = 0

    def select(self, candidates: Sequence[int], request: PreprocessedRequest | None) -> int:
        choice = candidates[self._counter % len(candidates)]
        self._counter += 1
        return choice


class RandomSelector(InstanceSelector):
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, candidates: Sequence[int], request: PreprocessedRequest | None) -> int:
        return candidates[self._rng.randrange(len(candidates))]


class DirectSelector(InstanceSelector):
    """The request names its instance (``nvext.backend_instance_id``); the push router
    honours pins itself, so this is only reached by a request without one: the client's
    error (HTTP 400), not the deployment's."""

    needs_pin = True

    def select(self, candidates: Sequence[int], request: PreprocessedRequest | None) -> int:
        if request is None or request.backend_instance_id is None:
            raise RequestError(
                "router mode 'direct' needs the request to name its instance "
                "(nvext.backend_instance_id)",
                param="nvext.backend_instance_id",
            )
        return request.backend_instance_id


def make_selector(
    mode: RouterMode,
    *,
    seed: int | None = None,
    load: InstanceLoad | None = None,
    device_types: Callable[[], Mapping[int, str]] | None = None,
    cpu_gpu_ratio: int | None = None,
) -> InstanceSelector:
    """The selector for a simple mode; KV mode is built by the KV router, not here.

    ``load``: the in-flight counts the load-based modes read (the push router's; a new one
    if None); ``device_types`` and ``cpu_gpu_ratio``: ``device-aware-weighted`` only."""
    if mode in (
        RouterMode.POWER_OF_TWO,
        RouterMode.LEAST_LOADED,
        RouterMode.DEVICE_AWARE_WEIGHTED,
    ):
        from turnout.router import load_selectors as ls

        load = load if load is not None else InstanceLoad()
        if mode is RouterMode.POWER_OF_TWO:
            return ls.PowerOfTwoSelector(load, seed)
        if mode is RouterMode.LEAST_LOADED:
            return ls.LeastLoadedSelector(load, seed)
        ratio = ls.DEFAULT_CPU_GPU_RATIO if cpu_gpu_ratio is None else cpu_gpu_ratio
        if ratio < 1:
            raise ConfigError(f"--router-cpu-gpu-ratio must be an integer >= 1, got {ratio}")
        return ls.DeviceAwareSelector(load, device_types or dict, ratio=ratio, seed=seed)
    if mode is RouterMode.ROUND_ROBIN:
        return RoundRobinSelector()
    if mode is RouterMode.RANDOM:
        return RandomSelector(seed)
    if mode is RouterMode.DIRECT:
        return DirectSelector()
    if mode is RouterMode.KV:
        raise ConfigError("router mode 'kv' is built by the KV router, not as a selector")
    raise NotYetSupported(
        f"router mode {mode.value!r} is not yet supported; supported now: "
        "round-robin, random, direct, kv"
    )
