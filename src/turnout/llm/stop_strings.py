"""Stop-string matching for the backend's jail: an Aho-Corasick automaton over one request's
stop strings, fed the generated text one piece at a time.

Mental model: the automaton's state after some text is the longest suffix of that text that
is a prefix of some stop string (a node of the trie of the stops). Two things the jail needs
fall out of it, for every character, in O(1) amortized time and whatever the number or length
of the stop strings:

* a **match**: the longest stop string that ends here (``_match_len``/``_match_index`` of the
  state, inherited along the failure links from the shorter stops that end with it);
* the **held text**: the longest suffix of the text that may still *become* a stop string,
  i.e. that is a proper prefix of one (``_hold`` of the state: the deepest node on its failure
  chain that has children).

Why hand-rolled: the jail runs per token, on the event loop, for every request that sets stop
strings; a table of every proper prefix of every stop (what this replaced) costs L²/2
characters per stop string, and a per-stop ``endswith`` search costs O(L) Python steps per
token. The automaton costs O(total stop length) to build, once per distinct set of stops
(cached), and one dict lookup per generated character (none for text that holds no stop's
first character while nothing is held).

Invariants (``StopMatcher`` is immutable once built, shared by every decoder of its stops):
node 0 is the root; ``_fail[n]`` is shallower than ``n``; ``_hold[n] <= _depth(n)``;
``_match_len[n]`` is 0 when no stop ends at ``n``.
"""

from __future__ import annotations

from collections import OrderedDict
from threading import Lock

#: Shared by every leaf node: leaves have no transitions (read only, never written).
_NO_EDGES: dict[str, int] = {}


class StopMatcher:
    """The automaton of one tuple of (non-empty) stop strings. See the module docstring."""

    __slots__ = (
        "_fail",
        "_goto",
        "_hold",
        "_match_index",
        "_match_len",
        "first_chars",
        "max_len",
        "num_nodes",
        "stops",
    )

    def __init__(self, stops: tuple[str, ...]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings must be non-empty, and at least one")
        self.stops = stops
        self.max_len = max(map(len, stops))
        #: A text with none of these, fed while nothing is held, leaves the root untouched.
        self.first_chars = frozenset(s[0] for s in stops)
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal = [-1]  # the (first) stop string that ends exactly at the node
        for index, stop in enumerate(stops):
            node = 0
            for ch in stop:
                edges = goto[node]
                nxt = edges.get(ch)
                if nxt is None:
                    nxt = edges[ch] = len(goto)
                    goto.append({})
                    depth.append(depth[node] + 1)
                    terminal.append(-1)
                node = nxt
            if terminal[node] < 0:
                terminal[node] = index
        n = len(goto)
        fail = [0] * n
        match_len = [0] * n
        match_index = [-1] * n
        hold = [0] * n
        # Breadth first: a node's failure target is shallower, so it is complete before it.
        order = list(goto[0].values())
        for node in order:  # the root's children fail to the root
            self._finish_node(node, 0, depth, terminal, goto, match_len, match_index, hold)
        i = 0
        while i < len(order):
            node = order[i]
            i += 1
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                target = goto[f].get(ch, 0)
                fail[child] = target
                self._finish_node(
                    child, target, depth, terminal, goto, match_len, match_index, hold
                )
                order.append(child)
        self._goto = tuple(edges if edges else _NO_EDGES for edges in goto)
        self._fail = fail
        self._match_len = match_len
        self._match_index = match_index
        self._hold = hold
        self.num_nodes = n

    @staticmethod
    def _finish_node(
        node: int,
        target: int,
        depth: list[int],
        terminal: list[int],
        goto: list[dict[str, int]],
        match_len: list[int],
        match_index: list[int],
        hold: list[int],
    ) -> None:
        """A node's match and hold, from its own trie data or its failure target's."""
        if terminal[node] >= 0:
            match_len[node], match_index[node] = depth[node], terminal[node]
        else:
            match_len[node], match_index[node] = match_len[target], match_index[target]
        hold[node] = depth[node] if goto[node] else hold[target]

    def hold(self, state: int) -> int:
        """How many characters at the end of the text fed so far may still become a stop."""
        return self._hold[state]

    def scan(self, state: int, text: str, offset: int, find: bool) -> tuple[int, int, int]:
        """Feed ``text`` from ``state``; returns ``(state, start, index)``.

        With ``find``, ``start`` is where the earliest-starting stop string found here
        begins, counted from ``offset`` characters before ``text`` (the held text), and
        ``index`` is that stop's place in ``stops`` (the first listed on a tie); both are
        -1 when none completes. Past a match the scan stops once no later match can begin
        as early, so the returned state is only good for a stream that ends there."""
        goto = self._goto
        fail = self._fail
        match_len = self._match_len
        match_index = self._match_index
        max_len = self.max_len
        best = best_index = -1
        pos = offset
        for ch in text:
            pos += 1
            while True:
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if not state:
                    break
                state = fail[state]
            if find:
                length = match_len[state]
                if length:
                    start = pos - length
                    index = match_index[state]
                    if best < 0 or start < best or (start == best and index < best_index):
                        best, best_index = start, index
                if best >= 0 and pos - max_len >= best:
                    break  # a later match would start after ``best``
        return state, best, best_index


#: Most automaton nodes (about the total length of their stop strings) kept in the cache:
#: the same few stop lists come back request after request, and every choice of an ``n`` > 1
#: request shares one. A few MB at most.
_CACHE_NODES = 1 << 16
_cache: OrderedDict[tuple[str, ...], StopMatcher] = OrderedDict()
_cache_nodes = 0
_cache_lock = Lock()


def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The automaton of ``stops``, from a small LRU cache bounded by total size."""
    global _cache_nodes
    with _cache_lock:
        matcher = _cache.get(stops)
        if matcher is not None:
            _cache.move_to_end(stops)
            return matcher
    matcher = StopMatcher(stops)
    if matcher.num_nodes > _CACHE_NODES // 4:
        return matcher  # too big to be worth keeping
    with _cache_lock:
        if stops not in _cache:
            _cache[stops] = matcher
            _cache_nodes += matcher.num_nodes
            while _cache_nodes > _CACHE_NODES:
                _, old = _cache.popitem(last=False)
                _cache_nodes -= old.num_nodes
    return matcher


__all__ = ["StopMatcher", "stop_matcher"]
