"""A planner's record in the discovery store: its candidacy in its namespace's election.

``v1/planner/{namespace}/candidates/{lease_id:x}`` → ``Candidate`` JSON, under the planner's
lease. The candidate the store wrote first (lowest revision) leads (``planner.leader``).
"""

from __future__ import annotations

import msgspec

PLANNER_ROOT = "v1/planner"


def candidates_prefix(namespace: str) -> str:
    return f"{PLANNER_ROOT}/{namespace}/candidates/"


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """A planner standing for election: who it is and where its decisions can be read."""

    host: str
    pid: int
    #: Its HTTP endpoint (``/planner/decisions``, ``/metrics``).
    url: str = ""
