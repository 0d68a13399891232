"""A rate-limited, counted log of the peers a plane refuses.

A plane that refuses peers (the ``tcp`` request plane at the TLS handshake, the ``zmq`` event
plane at ZAP) must leave a trace of each, but a flood of bad connections must not flood the
logs: ``RefusalLog`` writes at most one warning line per peer host per interval and a bounded
number of lines per interval in all, and counts every refusal by reason.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

#: Seconds between two refusal lines about the same peer host.
REFUSAL_LOG_INTERVAL = 60.0
#: Peer hosts whose last refusal line is remembered (expired ones, then the oldest, go first).
REFUSAL_LOG_PEERS = 1024
#: Refusal lines written per interval, all hosts together (many addresses flooding at once).
REFUSAL_LOG_LINES = 30
#: Distinct reasons counted; the refusals for any further reason are counted under ``OTHER``.
REFUSAL_LOG_REASONS = 64
#: The reason counted once ``REFUSAL_LOG_REASONS`` distinct reasons are held.
OTHER = "other"


class RefusalLog:
    """Logs the peers ``plane`` refused on ``logger`` at warning level, rate-limited, and counts
    every refusal by reason.

    At most one line per peer host per ``interval`` seconds and ``max_lines`` lines per
    interval in all; a line reports the refusals of its host not logged since the host's last
    line. ``peers`` bounds the table of hosts' last lines (expired entries, then the oldest,
    make room); ``max_reasons`` bounds the counters. ``clock`` is injectable for tests."""

    def __init__(
        self,
        plane: str,
        logger: logging.Logger,
        *,
        interval: float = REFUSAL_LOG_INTERVAL,
        peers: int = REFUSAL_LOG_PEERS,
        max_lines: int = REFUSAL_LOG_LINES,
        max_reasons: int = REFUSAL_LOG_REASONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: The plane, first on each line ("tcp request plane", "zmq event plane").
        self.plane = plane
        self.logger = logger
        self.interval = interval
        self.peers = peers
        self.max_lines = max_lines
        self.max_reasons = max_reasons
        self.clock = clock
        #: Refusals since the process started, by reason.
        self.counts: Counter[str] = Counter()
        #: Host -> (time of its last line, refusals not logged since); oldest first.
        self._last: dict[str, tuple[float, int]] = {}
        self._window_start = -float("inf")
        self._window_lines = 0

    @property
    def num_refused(self) -> int:
        return sum(self.counts.values())

    def refused(self, host: str, peer: str, reason: str) -> bool:
        """Count a refusal of ``peer`` (what was refused, for the line: "TLS handshake from
        10.0.0.1:5000", "subscriber 10.0.0.1") on ``host`` for ``reason``; True when it was
        logged."""
        counted = reason if reason in self.counts or len(self.counts) < self.max_reasons else OTHER
        self.counts[counted] += 1
        now = self.clock()
        last = self._last.get(host)
        if last is not None and now - last[0] < self.interval:
            self._last[host] = (last[0], last[1] + 1)
            return False
        if now - self._window_start >= self.interval:
            self._window_start = now
            self._window_lines = 0
        if self._window_lines >= self.max_lines:
            return False
        self._window_lines += 1
        unlogged = last[1] if last is not None else 0
        self._last.pop(host, None)
        if len(self._last) >= self.peers:
            self._forget(now)
        self._last[host] = (now, 0)
        more = f" ({unlogged} more from this host since its last line)" if unlogged else ""
        self.logger.warning("%s: refused %s: %s%s", self.plane, peer, reason, more)
        return True

    def _forget(self, now: float) -> None:
        """Room for one host: drop the expired entries, or the oldest when none has expired."""
        expired = [h for h, (at, _) in self._last.items() if now - at >= self.interval]
        for host in expired:
            del self._last[host]
        if len(self._last) >= self.peers:
            del self._last[next(iter(self._last))]
