"""Who may call the frontend, of ``turnout frontend`` and ``turnout serve``: API keys, JWTs,
the routes open without a key, HTTPS; and the tenants' flags: which tenants share one cache
space (``--shared-cache-tenants``) and how many have their own label in the tenants' metrics
(``--tenant-metrics-max``)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from turnout.errors import ConfigError
from turnout.frontend.access.jwt import JwtConfig
from turnout.frontend.http.access_gate import PUBLIC_ROUTE_CHOICES

from .flags import add_flag, env_name

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


def _env_list(flag: str) -> list[str]:
    """A repeatable flag's default: its environment variable's comma-separated values."""
    value = os.environ.get(env_name(flag), "")
    return [item.strip() for item in value.split(",") if item.strip()]


def add_access_flags(p: argparse.ArgumentParser) -> None:
    """Who may call the frontend (``frontend.access``), and HTTPS."""
    g = p.add_argument_group("access: API keys, JWTs, HTTPS (without keys or JWTs the "
                             "frontend is open to whoever reaches it)")  # fmt: skip
    # Not add_flag: a key must never be printed as a default in --help.
    g.add_argument("--api-key", action="append", default=_env_list("--api-key"),
                   help="a key callers send as 'Authorization: Bearer' or 'x-api-key' "
                        "(repeatable; tenant 'default', not admin) "
                        f"[env {env_name('--api-key')}, comma-separated]")  # fmt: skip
    add_flag(g, "--api-keys-file",
             help="TOML of [[keys]] tables: key or sha256, tenant, and optional admin, rps, "
                  "tokens_per_minute, max_concurrent, priority; SIGHUP reloads it")  # fmt: skip
    g.add_argument("--public-route", action="append", default=_env_list("--public-route"),
                   choices=PUBLIC_ROUTE_CHOICES,
                   help="a route open without a key (repeatable; /health and /live always "
                        f"are) [env {env_name('--public-route')}, comma-separated]")  # fmt: skip
    add_flag(g, "--jwt-issuer",
             help="accept JWT bearer tokens of this issuer (iss); needs --jwt-audience and "
                  "--jwt-jwks-file")  # fmt: skip
    add_flag(g, "--jwt-audience", help="the audience (aud) tokens must name")
    add_flag(g, "--jwt-jwks-file",
             help="the issuer's public keys (a JWKS, JSON); read at start and on SIGHUP, "
                  "never fetched")  # fmt: skip
    add_flag(g, "--jwt-tenant-claim", default="tenant",
             help="the claim that names the caller's tenant")  # fmt: skip
    add_flag(
        g,
        "--jwt-admin-claim",
        help="a claim that, when true, makes the caller an admin (default: none is)",
    )
    add_flag(g, "--tls-cert", help="serve HTTPS with this certificate chain (PEM)")
    add_flag(g, "--tls-key", help="the private key of --tls-cert (PEM)")
    add_tenant_flags(g)


def jwt_config(args: argparse.Namespace) -> JwtConfig | None:
    """The ``--jwt-*`` flags, all three of issuer, audience and JWKS file, or none."""
    given = [args.jwt_issuer, args.jwt_audience, args.jwt_jwks_file]
    if not any(given):
        return None
    if not all(given):
        raise ConfigError("--jwt-issuer, --jwt-audience and --jwt-jwks-file go together")
    return JwtConfig(
        issuer=args.jwt_issuer,
        audience=args.jwt_audience,
        jwks_file=args.jwt_jwks_file,
        tenant_claim=args.jwt_tenant_claim,
        admin_claim=args.jwt_admin_claim,
    )
