"""The audit log of admin actions: one line per action on a control route, on the logger
``turnout.audit`` (route it to its own file or sink with the logging configuration).

A line says who (the credential's ``key_id``, never the key, and its tenant), what (the
method and route), from where (the client's address), whether it was allowed, and the state
before and after (a refused action has neither). Values are JSON, so a line is one parseable
record after its ``audit`` prefix.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from turnout.frontend.access.principal import Principal

log = logging.getLogger("turnout.audit")

_json = msgspec.json.Encoder()


class AuditLog:
    """Writes admin actions to ``turnout.audit`` (see the module's docstring)."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self._log = logger

    def record(
        self,
        principal: Principal,
        *,
        method: str,
        route: str,
        client: str,
        before: Any = None,
        after: Any = None,
        allowed: bool = True,
    ) -> None:
        """One line for one action: allowed with its state ``before`` and ``after``, or
        refused (``allowed=False``)."""
        record: dict[str, Any] = {
            "key_id": principal.key_id,
            "tenant": principal.tenant,
            "method": method,
            "route": route,
            "client": client,
            "outcome": "allowed" if allowed else "denied",
        }
        if allowed:
            record["before"] = before
            record["after"] = after
        self._log.info("audit %s", _json.encode(record).decode())
