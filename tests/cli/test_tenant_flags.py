"""The tenants' flags: parsed from the command line or the environment, and checked."""

from __future__ import annotations

import argparse

import pytest

from turnout.cli.access_flags import (
    DEFAULT_TENANT_METRICS_MAX,
    TenantConfig,
    add_tenant_flags,
    tenant_config,
)
from turnout.cli.flags import env_name
from turnout.errors import ConfigError


def parse(*argv: str) -> TenantConfig:
    p = argparse.ArgumentParser()
    add_tenant_flags(p.add_argument_group("tenants"))
    return tenant_config(p.parse_args(argv))


def test_defaults_share_nothing() -> None:
    assert parse() == TenantConfig(frozenset(), DEFAULT_TENANT_METRICS_MAX)


def test_shared_tenants_are_a_comma_separated_list() -> None:
    config = parse("--shared-cache-tenants", " a, b ,,a", "--tenant-metrics-max", "7")
    assert config == TenantConfig(frozenset({"a", "b"}), 7)


def test_flags_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_name("--shared-cache-tenants"), "x,y")
    monkeypatch.setenv(env_name("--tenant-metrics-max"), "3")
    assert parse() == TenantConfig(frozenset({"x", "y"}), 3)


def test_tenant_metrics_max_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="--tenant-metrics-max"):
        parse("--tenant-metrics-max", "0")
