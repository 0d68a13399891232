"""The tenants' flags of ``turnout frontend`` and ``turnout serve``: which tenants share one
cache space (``--shared-cache-tenants``) and how many have their own label in the tenants'
metrics (``--tenant-metrics-max``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from turnout.errors import ConfigError

from .flags import add_flag

#: ``--tenant-metrics-max``'s default: tenants with their own series in ``turnout_tenant_*``
#: and their own entry in ``/admin/usage`` (the rest are counted under ``_other``).
DEFAULT_TENANT_METRICS_MAX = 100


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """What the tenants' flags say."""

    #: Tenants whose prompts hash into the un-tenanted cache space, shared with each other
    #: (``frontend.access.cache_space``); every other tenant has its own.
    shared_cache_tenants: frozenset[str] = frozenset()
    #: Tenants counted under their own label (``frontend.access.usage``).
    tenant_metrics_max: int = DEFAULT_TENANT_METRICS_MAX


def add_tenant_flags(p: argparse.ArgumentParser | Any) -> None:
    """Add the tenants' flags to ``p`` (a parser or an argument group)."""
    add_flag(p, "--shared-cache-tenants", default="",
             help="comma-separated tenants that share one cache space (each other's cached "
                  "prefixes, and those of callers without a key); every other tenant's "
                  "prompts are cached apart")  # fmt: skip
    add_flag(p, "--tenant-metrics-max", default=DEFAULT_TENANT_METRICS_MAX, type=int,
             help="tenants with their own label in turnout_tenant_* metrics and "
                  "/admin/usage; those past it are counted under '_other'")  # fmt: skip


def tenant_config(args: argparse.Namespace) -> TenantConfig:
    """The tenants' flags of ``args``; ``ConfigError`` for a value that cannot work."""
    names = [name.strip() for name in str(args.shared_cache_tenants).split(",")]
    shared = frozenset(name for name in names if name)
    if args.tenant_metrics_max < 1:
        raise ConfigError(f"--tenant-metrics-max must be at least 1, got {args.tenant_metrics_max}")
    return TenantConfig(shared_cache_tenants=shared, tenant_metrics_max=args.tenant_metrics_max)
