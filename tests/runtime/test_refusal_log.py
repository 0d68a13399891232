"""The planes' refusal log: one line per peer host per interval, a bound on lines per interval
and on the hosts remembered, the refusals a line did not log reported in the host's next one,
and every refusal counted by reason (a bounded set of reasons)."""

from __future__ import annotations

import logging

import pytest

from turnout.runtime.refusal_log import OTHER, RefusalLog
from turnout.runtime.request_plane.tcp.tls import tls_refusal_log

LOGGER = logging.getLogger("tests.refusal_log")


def test_refusals_are_logged_once_an_interval_per_host(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RefusalLog(
        "tcp request plane", LOGGER, interval=60.0, peers=2, max_lines=3, clock=lambda: now[0]
    )
    caplog.set_level(logging.WARNING, LOGGER.name)
    assert log.refused("10.0.0.1", "TLS handshake from 10.0.0.1:1", "bad")
    assert not log.refused("10.0.0.1", "TLS handshake from 10.0.0.1:2", "bad")  # same interval
    assert log.refused("10.0.0.2", "TLS handshake from 10.0.0.2:1", "bad")
    assert log.refused("10.0.0.3", "TLS handshake from 10.0.0.3:1", "bad")  # the oldest goes
    assert not log.refused("10.0.0.4", "TLS handshake from 10.0.0.4:1", "bad")  # 3 lines already
    now[0] = 61.0
    assert log.refused("10.0.0.3", "TLS handshake from 10.0.0.3:2", "worse")
    assert log.refused("10.0.0.1", "TLS handshake from 10.0.0.1:3", "bad")
    assert log.num_refused == 7 and log.counts == {"bad": 6, "worse": 1}
    assert len(log._last) <= 2
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER.name]
    assert len(lines) == 5
    assert lines[0] == "tcp request plane: refused TLS handshake from 10.0.0.1:1: bad"
    # 10.0.0.1 was forgotten (peers=2): its unlogged refusal is not reported.
    assert lines[-1] == "tcp request plane: refused TLS handshake from 10.0.0.1:3: bad"


def test_the_unlogged_refusals_of_a_host_are_reported_in_its_next_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = RefusalLog("zmq event plane", LOGGER, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, LOGGER.name)
    for _ in range(5):
        log.refused("10.0.0.1", "subscriber 10.0.0.1", "no key")
    now[0] = 60.0
    log.refused("10.0.0.1", "subscriber 10.0.0.1", "no key")
    assert [r.getMessage() for r in caplog.records] == [
        "zmq event plane: refused subscriber 10.0.0.1: no key",
        "zmq event plane: refused subscriber 10.0.0.1: no key"
        " (4 more from this host since its last line)",
    ]


def test_expired_hosts_make_room_before_the_oldest_live_one() -> None:
    now = [0.0]
    log = RefusalLog("p", LOGGER, interval=10.0, peers=2, clock=lambda: now[0])
    log.refused("a", "a", "bad")
    now[0] = 5.0
    log.refused("b", "b", "bad")
    now[0] = 11.0  # a expired, b not
    log.refused("c", "c", "bad")
    assert list(log._last) == ["b", "c"]


def test_the_reasons_counted_are_bounded() -> None:
    log = RefusalLog("p", LOGGER, max_reasons=2)
    for reason in ("one", "two", "three", "four", "one"):
        log.refused(reason, reason, reason)
    assert log.counts == {"one": 2, "two": 1, OTHER: 2}
    assert log.num_refused == 5


def test_the_tcp_plane_logs_on_its_own_logger() -> None:
    log = tls_refusal_log()
    assert log.plane == "tcp request plane" and log.logger.name == "turnout.runtime"
