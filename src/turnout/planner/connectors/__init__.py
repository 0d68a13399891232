"""How the planner changes the number of workers in a pool: ``local`` processes, Kubernetes
Deployments, or a gauge for an external autoscaler (``metrics_only``)."""

from .base import POOLS, Connector, ConnectorError

__all__ = ["POOLS", "Connector", "ConnectorError"]
