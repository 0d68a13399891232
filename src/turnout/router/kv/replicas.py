"""Which other KV router replicas are alive and hear this one: replica sync's presence.

Replicas of one model's KV router share their in-flight requests on the ``kv_router_active``
topic. A lone replica (one frontend, the common deployment) would publish every change for
nobody, so each replica says it is there instead, and publishes changes only while another
one hears it:

* every ``interval_s`` (2 s by default) a replica publishes a ``ReplicaPresence``: its id and
  the ids of the replicas it hears (``hears``);
* a peer is *alive* until ``expiry_s`` (3 intervals) after its last presence, then gone;
* a peer *listens* when its latest presence names this replica: its subscription delivers
  what this replica publishes (on the distributed planes a subscriber joins some time after
  it subscribed, so a presence received says nothing about the other direction);
* when a peer starts to listen, this replica sends it a snapshot of its own requests in
  flight (``ReplicaPresence.to`` names the peer, ``events`` rebuild them), so a replica that
  joined late, or came back, does not under-count the load; changes follow in order.

Change batches are published only while at least one alive peer listens. The peer table is
bounded (``max_peers``; presences of more are ignored) and keyed by router id.

A replica that sends change batches but no presence runs a version without presences (a
rolling upgrade): it publishes everything and listens to everything, so each of its batches
makes it an alive, listening peer for ``expiry_s`` (``on_batch``). When it falls silent it is
dropped from the table, but its requests are kept (they end by their own TTL, as they did
between such replicas).

Wire: a presence is a msgpack *map* (a keyword struct) and a change batch
(``ActiveSequenceBatch``) a msgpack *array*, so one topic carries both and the first byte of
a payload tells which it is (``is_presence``).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from turnout.router.kv.active_sequences import ActiveSequenceEvent

__all__ = [
    "DEFAULT_PRESENCE_INTERVAL_S",
    "MAX_PEERS",
    "ReplicaPeers",
    "ReplicaPresence",
    "is_presence",
]

#: Seconds between a replica's presences.
DEFAULT_PRESENCE_INTERVAL_S = 2.0
#: Presences a peer may miss before it counts as gone.
MISSED_PRESENCES = 3
#: Replicas one replica keeps track of, at most.
MAX_PEERS = 256


class ReplicaPresence(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A replica is alive (and, with ``to``, a snapshot of its requests for one peer)."""

    router_id: str
    #: The replicas this one hears (their presences reach it), at most ``MAX_PEERS``.
    hears: list[str] = msgspec.field(default_factory=list)
    #: The replica the ``events`` are for (others only note the presence).
    to: str | None = None
    #: The sender's requests in flight, as ``ActiveSequences.snapshot_events`` lists them.
    events: list[ActiveSequenceEvent] = msgspec.field(default_factory=list)


def is_presence(payload: bytes) -> bool:
    """Whether a ``kv_router_active`` payload is a presence (a msgpack map: fixmap, map16 or
    map32) rather than a change batch (an array)."""
    return bool(payload) and (0x80 <= payload[0] <= 0x8F or payload[0] in (0xDE, 0xDF))


@dataclass(slots=True)
class _Peer:
    """What one replica knows of another. Only ``ReplicaPeers`` changes it."""

    alive_until: float
    listens: bool
    #: Known from its change batches only: a replica without presences.
    legacy: bool = False


class ReplicaPeers:
    """The other replicas, alive and listening, on an injected clock (``now`` arguments).

    Synchronous and I/O-free: the router feeds it presences and ticks, and asks it whether
    to publish and to whom a snapshot is due.
    """

    def __init__(
        self,
        own_id: str,
        *,
        interval_s: float = DEFAULT_PRESENCE_INTERVAL_S,
        max_peers: int = MAX_PEERS,
    ) -> None:
        if not interval_s > 0 or max_peers < 1:
            raise ValueError(f"bad presence settings: interval {interval_s}, peers {max_peers}")
        self.own_id = own_id
        self.interval_s = interval_s
        self.expiry_s = MISSED_PRESENCES * interval_s
        self._max_peers = max_peers
        self._peers: dict[str, _Peer] = {}
        #: Alive peers that listen (derived: changed only in ``on_presence`` and ``expire``).
        self._num_listening = 0

    @property
    def listening(self) -> bool:
        """Whether any alive peer hears this replica (changes are worth publishing)."""
        return self._num_listening > 0

    def ids(self) -> list[str]:
        """The alive peers (what this replica's presence says it hears)."""
        return list(self._peers)

    def __contains__(self, router_id: object) -> bool:
        return router_id in self._peers

    def on_presence(self, presence: ReplicaPresence, now: float) -> tuple[bool, bool]:
        """Note a peer's presence: ``(new, snapshot_due)``. ``new``: the peer was not alive
        (answer with a presence at once, so it hears of this replica without waiting a beat);
        ``snapshot_due``: it has just started to listen (send it this replica's requests)."""
        router_id = presence.router_id
        listens = self.own_id in presence.hears
        peer = self._peers.get(router_id)
        if peer is None:
            if router_id == self.own_id or len(self._peers) >= self._max_peers:
                return False, False
            self._peers[router_id] = _Peer(now + self.expiry_s, listens)
            if listens:
                self._num_listening += 1
            return True, listens
        peer.alive_until = now + self.expiry_s
        peer.legacy = False
        if listens == peer.listens:
            return False, False
        peer.listens = listens
        self._num_listening += 1 if listens else -1
        return False, listens

    def on_batch(self, router_id: str, now: float) -> bool:
        """Note a change batch from ``router_id``; True when it makes a replica without
        presences a peer (see the module docstring). A peer that sends presences is judged by
        them alone."""
        peer = self._peers.get(router_id)
        if peer is None:
            if router_id == self.own_id or len(self._peers) >= self._max_peers:
                return False
            self._peers[router_id] = _Peer(now + self.expiry_s, True, legacy=True)
            self._num_listening += 1
            return True
        if peer.legacy:
            peer.alive_until = now + self.expiry_s
        return False

    def expire(self, now: float) -> list[str]:
        """Forget the peers silent for ``expiry_s``; returns the ids of those that sent
        presences (replicas without them are dropped from the table only)."""
        gone = [rid for rid, peer in self._peers.items() if peer.alive_until <= now]
        out = []
        for router_id in gone:
            peer = self._peers.pop(router_id)
            if peer.listens:
                self._num_listening -= 1
            if not peer.legacy:
                out.append(router_id)
        return out
