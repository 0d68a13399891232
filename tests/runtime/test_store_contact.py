"""How a process's lease keep-alives fare, as ``turnout_store_last_contact_seconds`` and
``turnout_store_keepalive_failures_total``: a store that stops answering shows there while
the lease is still retried."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from tests.polling import eventually

from turnout.runtime.discovery.memory import MemoryStore
from turnout.runtime.lease import Lease
from turnout.runtime.process_metrics import StoreContactCollector


class FlakyStore(MemoryStore):
    """A memory store whose keep-alives fail while ``down``."""

    down = False

    async def keep_alive(self, lease_id: int) -> bool:
        if self.down:
            raise ConnectionError("store unreachable")
        return await super().keep_alive(lease_id)


def sample(registry: CollectorRegistry, name: str) -> float | None:
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def test_an_unanswered_keep_alive_shows_as_time_since_the_last_contact() -> None:
    store = FlakyStore()
    now = [1000.0]
    registry = CollectorRegistry()
    registry.register(StoreContactCollector(lambda: store, clock=lambda: now[0]))
    assert sample(registry, "turnout_store_last_contact_seconds") is None  # no lease yet
    lease = await Lease.grant(store, ttl=0.3)
    try:
        await eventually(lambda: store.contact.last_ok is not None, timeout=5)
        last_ok = store.contact.last_ok
        assert last_ok is not None
        now[0] = last_ok + 2.5
        assert sample(registry, "turnout_store_last_contact_seconds") == 2.5
        store.down = True
        await eventually(lambda: store.contact.failures >= 2, timeout=5)
        assert store.contact.last_ok == last_ok or not store.down
        failures = sample(registry, "turnout_store_keepalive_failures_total")
        assert failures is not None and failures >= 2
        store.down = False
        await eventually(lambda: store.contact.last_ok != last_ok, timeout=5)
    finally:
        await lease.revoke()
        await store.close()
