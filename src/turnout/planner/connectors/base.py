"""The interface every connector implements."""

from __future__ import annotations

from typing import Protocol

from turnout.errors import TurnoutError

#: The pools a planner sizes: ``aggregated`` workers run whole requests; under disaggregated
#: serving ``prefill`` workers run prompts and ``decode`` workers the rest.
POOLS = ("aggregated", "prefill", "decode")


class ConnectorError(TurnoutError):
    """A connector could not read or change a pool (the planner logs it and tries again at
    its next decision)."""


class Connector(Protocol):
    """Changes the replica count of pools. Every method has a deadline of its own: a connector
    whose backend does not answer raises ``ConnectorError``, never hangs the planner."""

    #: ``local``, ``kubernetes``, ``metrics-only``.
    name: str

    async def start(self) -> None:
        """Connect (read credentials, check the targets exist). Failing here is fatal."""

    async def replicas(self, pool: str) -> int | None:
        """The replica count the backend is asked to run for ``pool`` now (Kubernetes: the
        Deployment's ``spec.replicas``), or None when the connector does not know (the
        planner then counts the pool's instances in discovery)."""

    async def scale(self, pool: str, replicas: int, *, drain_first: list[int]) -> None:
        """Run ``replicas`` workers in ``pool``. On a scale-down, ``drain_first`` names the
        instance ids the planner would remove first (the least loaded); a connector that
        chooses its own victims (Kubernetes) may ignore it. Removed workers leave routing
        and finish or hand back their streams before they stop (SIGTERM: the worker revokes
        its lease, then drains)."""

    async def close(self, *, stop_workers: bool) -> None:
        """Release what the connector holds; ``stop_workers``: also stop the workers it
        started (a local planner that is the last of its deployment)."""
