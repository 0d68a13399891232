"""Simulated LoRA adapters of a mocker worker: which it can load, which it holds, which it evicts.

Mental model (vLLM's ``LRUCacheWorkerLoRAManager`` with a load that takes time):

* A worker is configured with the adapters it *can* load (``--lora-adapters name[=path],...``);
  nothing is loaded at start.
* The first request that names an adapter loads it: the request waits the cold-load time
  (``--lora-load-ms``, divided by ``--speedup-ratio`` like every simulated duration), and every
  other request for that adapter arriving meanwhile waits for the same load.
* At most ``--max-loras`` adapters are resident (loading or loaded). Loading one more evicts the
  least recently used adapter that no request in flight uses; when every resident adapter is in
  use, the request waits until one is released.
* Each transition into ``LOADED`` and out of it is reported to a listener (the worker), which
  publishes and removes the adapter's model card: a card exists exactly while the adapter is
  loaded, as Dynamo does.

``LoraSlots`` is the synchronous state machine (testable without an event loop; time is passed
in); ``LoraManager`` puts the waits around it.
"""

from __future__ import annotations

import asyncio
import enum
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from turnout.errors import ConfigError

__all__ = [
    "ADAPTER_NAME_PATTERN",
    "AdapterState",
    "Begin",
    "LoraListener",
    "LoraManager",
    "LoraSlots",
    "parse_lora_adapters",
    "validate_lora_settings",
]

#: What an adapter name may look like: it becomes the last segment of a discovery key
#: (``v1/mdc/.../{instance_id:x}/{lora}``) and a served model name.
ADAPTER_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def parse_lora_adapters(text: str | None) -> dict[str, str | None]:
    """``"a=/p/a,b"`` -> ``{"a": "/p/a", "b": None}``; a bad or repeated name is a
    ``ConfigError`` naming it (one clear line at start-up)."""
    adapters: dict[str, str | None] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, path = item.partition("=")
        name = name.strip()
        if not ADAPTER_NAME_PATTERN.match(name):
            raise ConfigError(
                f"--lora-adapters: bad adapter name {name!r} (letters, digits, '.', '_', ':', "
                "'-'; at most 128 characters)"
            )
        if name in adapters:
            raise ConfigError(f"--lora-adapters: adapter {name!r} is named twice")
        adapters[name] = path.strip() or None if sep else None
    return adapters


def validate_lora_settings(
    adapters: Mapping[str, str | None], lora_load_ms: float, max_loras: int
) -> None:
    """``ConfigError`` for the first bad LoRA setting of a mocker."""
    for name in adapters:
        if not ADAPTER_NAME_PATTERN.match(name):
            raise ConfigError(f"bad LoRA adapter name {name!r}")
    if not (math.isfinite(lora_load_ms) and lora_load_ms >= 0):
        raise ConfigError(f"lora_load_ms must be a finite number >= 0, got {lora_load_ms!r}")
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
        raise ConfigError(f"max_loras must be a positive integer, got {max_loras!r}")


class AdapterState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"


class Begin(enum.Enum):
    """What ``LoraSlots.begin`` decided for a request."""

    READY = "ready"  # loaded: the request holds it and runs now
    WAIT_LOAD = "wait_load"  # being loaded: the request holds it and waits for the load
    LOAD = "load"  # the request holds it and must run the load (``evicted`` were dropped)
    FULL = "full"  # every slot is in use: nothing changed, wait for a release
    UNKNOWN = "unknown"  # this worker cannot load that adapter


@dataclass(slots=True)
class _Adapter:
    """One loadable adapter. ``state`` changes only in ``LoraSlots``; ``refs`` counts the
    requests in flight holding it (begun, not yet released); ``last_used`` is the clock
    reading of the last release (LRU order among idle adapters)."""

    name: str
    path: str | None
    state: AdapterState = AdapterState.UNLOADED
    refs: int = 0
    last_used: float = 0.0


class LoraSlots:
    """The adapters of one worker and their residency; see the module docstring.

    Invariant: the number of adapters ``LOADING`` or ``LOADED`` (``num_resident``) never
    exceeds ``max_loras``; an adapter with ``refs > 0`` is never evicted.
    """

    __slots__ = ("_adapters", "_max_loras", "_num_resident")

    def __init__(self, adapters: Mapping[str, str | None], max_loras: int) -> None:
        self._adapters = {name: _Adapter(name, path) for name, path in adapters.items()}
        self._max_loras = max_loras
        self._num_resident = 0

    @property
    def num_resident(self) -> int:
        return self._num_resident

    def loadable(self) -> list[str]:
        """Every adapter this worker can load, sorted."""
        return sorted(self._adapters)

    def path(self, name: str) -> str | None:
        adapter = self._adapters.get(name)
        return adapter.path if adapter is not None else None

    def state(self, name: str) -> AdapterState:
        adapter = self._adapters.get(name)
        return adapter.state if adapter is not None else AdapterState.UNLOADED

    def loaded(self) -> list[str]:
        """The adapters loaded now, sorted."""
        return sorted(a.name for a in self._adapters.values() if a.state is AdapterState.LOADED)

    def begin(self, name: str) -> tuple[Begin, list[str]]:
        """A request wants ``name``: decide, and (except ``FULL``/``UNKNOWN``) count it as
        holding the adapter. Returns the decision and the adapters evicted to make room."""
        adapter = self._adapters.get(name)
        if adapter is None:
            return Begin.UNKNOWN, []
        if adapter.state is AdapterState.LOADED:
            adapter.refs += 1
            return Begin.READY, []
        if adapter.state is AdapterState.LOADING:
            adapter.refs += 1
            return Begin.WAIT_LOAD, []
        evicted: list[str] = []
        if self._num_resident >= self._max_loras:
            idle = [
                a for a in self._adapters.values() if a.state is AdapterState.LOADED and a.refs == 0
            ]
            if not idle:
                return Begin.FULL, []
            victim = min(idle, key=lambda a: a.last_used)
            victim.state = AdapterState.UNLOADED
            self._num_resident -= 1
            evicted.append(victim.name)
        adapter.state = AdapterState.LOADING
        adapter.refs += 1
        self._num_resident += 1
        return Begin.LOAD, evicted

    def finish_load(self, name: str) -> None:
        adapter = self._adapters[name]
        if adapter.state is not AdapterState.LOADING:
            raise RuntimeError(f"adapter {name!r} finished loading while {adapter.state.value}")
        adapter.state = AdapterState.LOADED

    def release(self, name: str, now: float) -> None:
        """A request holding ``name`` ended (finished, failed or cancelled)."""
        adapter = self._adapters[name]
        if adapter.refs <= 0:
            raise RuntimeError(f"adapter {name!r} released more often than begun")
        adapter.refs -= 1
        adapter.last_used = now


#: ``(adapter, loaded)``: called when an adapter becomes loaded (True) or is evicted (False).
LoraListener = Callable[[str, bool], None]


def _no_listener(name: str, loaded: bool) -> None:
    pass


class LoraManager:
    """The waits around ``LoraSlots``: loads that take (simulated) time, requests waiting for
    a free slot, and the listener told of loads and evictions.

    ``acquire`` then ``release`` once per request that names an adapter. A load, once begun,
    runs to the end even if the request that began it is cancelled (others may wait on it).
    """

    def __init__(
        self,
        adapters: Mapping[str, str | None],
        *,
        max_loras: int,
        load_seconds: float,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.slots = LoraSlots(adapters, max_loras)
        self._load_seconds = load_seconds
        self._clock = clock
        self._sleep = sleep
        self._listener: LoraListener = _no_listener
        # Adapter -> the load in progress; waiters for a free slot, woken one by release.
        # Both are bounded by the requests in flight (which the scheduler bounds).
        self._loads: dict[str, asyncio.Future[None]] = {}
        self._slot_waiters: list[asyncio.Future[None]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def set_listener(self, listener: LoraListener) -> None:
        self._listener = listener

    def can_load(self, name: str) -> bool:
        return name in self.slots.loadable()

    async def acquire(self, name: str) -> bool:
        """Hold ``name`` for one request, loading it first if need be. False when this
        worker cannot load it (nothing held). On cancellation nothing is held."""
        loop = asyncio.get_running_loop()
        while True:
            decision, evicted = self.slots.begin(name)
            if decision is Begin.UNKNOWN:
                return False
            if decision is Begin.FULL:
                waiter = loop.create_future()
                self._slot_waiters.append(waiter)
                try:
                    await waiter
                finally:
                    if waiter in self._slot_waiters:
                        self._slot_waiters.remove(waiter)
                continue
            break
        for victim in evicted:
            self._listener(victim, False)
        if decision is Begin.READY:
            return True
        if decision is Begin.LOAD:
            self._loads[name] = loop.create_future()
            task = loop.create_task(self._load(name), name=f"lora-load-{name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            await asyncio.shield(self._loads[name])
        except BaseException:
            self.release(name)
            raise
        return True

    async def _load(self, name: str) -> None:
        cancelled = False
        try:
            if self._load_seconds > 0:
                await self._sleep(self._load_seconds)
        except asyncio.CancelledError:
            cancelled = True  # the engine stops: finish the books, announce nothing
            raise
        finally:
            self.slots.finish_load(name)
            done = self._loads.pop(name)
            if not done.done():
                done.set_result(None)
            if not cancelled:
                self._listener(name, True)

    def release(self, name: str) -> None:
        """The request holding ``name`` ended; every request waiting for a slot looks again
        (a release frees a slot only when it was the adapter's last holder)."""
        self.slots.release(name, self._clock())
        waiters, self._slot_waiters = self._slot_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
