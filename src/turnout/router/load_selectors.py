"""The load-based router modes, as Dynamo 1.x defines them, over ``InstanceLoad``.

* ``power-of-two``: two distinct candidates drawn at random; the one with fewer requests in
  flight (a tie goes to the first drawn, itself random). One candidate: it.
* ``least-loaded``: the candidate with the fewest in flight; ties broken at random.
* ``device-aware-weighted``: candidates split by the device their card announces (``cpu``
  or anything else, counted as GPU). With both groups present, the CPU group takes the
  request while its total in flight is under its budget, Dynamo's integer form::

      allowed_cpu = gpu_in_flight * num_cpu // (ratio * num_gpu)      (ratio >= 1, default 8)
      CPU group  if cpu_in_flight < allowed_cpu,  else the GPU group

  (``ratio``: how many CPU instances one GPU instance is worth); least-loaded within the
  chosen group. With one group present: least-loaded in it. The choice weighs load only.

Randomness comes from a seeded ``random.Random``; load from the push router's counts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

from turnout.protocols.llm import PreprocessedRequest
from turnout.protocols.model import DEVICE_CPU
from turnout.router.instance_load import InstanceLoad
from turnout.router.selectors import InstanceSelector

__all__ = [
    "DEFAULT_CPU_GPU_RATIO",
    "DeviceAwareSelector",
    "LeastLoadedSelector",
    "PowerOfTwoSelector",
]

#: Dynamo's default (``DYN_ENCODER_CUDA_TO_CPU_RATIO`` / ``non_cpu_to_cpu_ratio``).
DEFAULT_CPU_GPU_RATIO = 8

#: Instance id -> device type (``cpu``, ``gpu``) of the candidates, from their cards.
DeviceTypes = Callable[[], Mapping[int, str]]


def least_loaded(candidates: Sequence[int], load: InstanceLoad, rng: random.Random) -> int:
    """The candidate with the fewest in flight; ties at random (reservoir sampling)."""
    best = candidates[0]
    best_load = load.in_flight(best)
    ties = 1
    for instance_id in candidates[1:]:
        n = load.in_flight(instance_id)
        if n < best_load:
            best, best_load, ties = instance_id, n, 1
        elif n == best_load:
            ties += 1
            if rng.randrange(ties) == 0:
                best = instance_id
    return best


class PowerOfTwoSelector(InstanceSelector):
    def __init__(self, load: InstanceLoad, seed: int | None = None) -> None:
        self.load = load
        self._rng = random.Random(seed)

    def select(self, candidates: Sequence[int], request: PreprocessedRequest | None) -> int:
        n = len(candidates)
        first = self._rng.randrange(n)
        if n == 1:
            return candidates[first]
        second = (first + 1 + self._rng.randrange(n - 1)) % n
        a, b = candidates[first], candidates[second]
        return a if self.load.in_flight(a) <= self.load.in_flight(b) else b


class LeastLoadedSelector(InstanceSelector):
    def __init__(self, load: InstanceLoad, seed: int | None = None) -> None:
        self.load = load
        self._rng = random.Random(seed)

    def select(self, candidates: Sequence[int], request: PreprocessedRequest | None) -> int:
        return least_loaded(candidates, self.load, self._rng)


class DeviceAwareSelector(InstanceSelector):
    def __init__(
        self,
        load: InstanceLoad,
        device_types: DeviceTypes,
        *,
        ratio: int = DEFAULT_CPU_GPU_RATIO,
        seed: int | None = None,
    ) -> None:
        if ratio < 1:
            raise ValueError(f"the CPU/GPU ratio must be >= 1, got {ratio}")
        self.load = load
        self.ratio = ratio
        self._device_types = device_types
        self._rng = random.Random(seed)

    def select(self, candidates: Sequence[int], request: PreprocessedRequest | None) -> int:
        devices = self._device_types()
        cpu = [c for c in candidates if devices.get(c) == DEVICE_CPU]
        if not cpu or len(cpu) == len(candidates):
            return least_loaded(candidates, self.load, self._rng)
        gpu = [c for c in candidates if devices.get(c) != DEVICE_CPU]
        allowed_cpu = self.load.total(gpu) * len(cpu) // (self.ratio * len(gpu))
        group = cpu if self.load.total(cpu) < allowed_cpu else gpu
        return least_loaded(group, self.load, self._rng)
