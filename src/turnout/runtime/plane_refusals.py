"""Refusing instances that run other planes than this process.

Every process of a deployment must run the same request and event planes: a worker on
another request plane may still be reachable (a process keeps a client per transport), so it
would take requests while its KV events and load reports go where nobody listens. A frontend
(and a standalone router) therefore refuses such an instance: it is not routed to, and one
warning line per instance says so, naming its host and pid and both plane sets. A record
that names no plane (a process older than the fields) is accepted.
"""

from __future__ import annotations

import logging

from turnout.protocols.model import Instance

logger = logging.getLogger("turnout.runtime")


class PlaneRefusals:
    """Which instances run other planes than ``request_plane``/``event_plane``, each logged
    once. ``role`` names this process in the warning and the reason (``"frontend"``)."""

    def __init__(self, request_plane: str, event_plane: str, role: str) -> None:
        self.request_plane = request_plane
        self.event_plane = event_plane
        self._role = role
        #: Instance id -> why it is refused; only ids the owner still knows (``retain``).
        self._refused: dict[int, str] = {}

    def refuses(self, instance: Instance | None) -> bool:
        """True when ``instance`` runs other planes (logged the first time); None: not
        known yet, not refused."""
        if instance is None or not instance.runs_other_planes(self.request_plane, self.event_plane):
            return False
        instance_id = instance.instance_id
        if instance_id not in self._refused:
            mine = f"{self.request_plane}/{self.event_plane}"
            self._refused[instance_id] = f"instance runs {instance.planes()}, {self._role} {mine}"
            logger.warning(
                "instance %x at %s runs request plane %s, event plane %s; this %s runs %s: "
                "refused; every process must use the same planes",
                instance_id,
                instance.where(),
                instance.request_plane or "?",
                instance.event_plane or "?",
                self._role,
                mine,
            )
        return True

    def reason(self, instance_id: int) -> str | None:
        """Why ``instance_id`` was refused (None: it was not)."""
        return self._refused.get(instance_id)

    def forget(self, instance_id: int) -> None:
        """``instance_id`` left: a later refusal of the same id is logged again."""
        self._refused.pop(instance_id, None)

    def retain(self, instance_ids: set[int]) -> None:
        """Forget every refusal but those of ``instance_ids`` (the instances still known)."""
        for instance_id in self._refused.keys() - instance_ids:
            del self._refused[instance_id]
