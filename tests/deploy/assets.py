"""What the deployment-asset tests share: the files under ``deploy/``, read as data, and the
real ``turnout`` command-line parser that the settings they name must satisfy."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from turnout.cli.flags import env_name
from turnout.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"
#: Where the image and the systemd units keep turnout's virtual environment.
VENV_TURNOUT = "/opt/turnout/.venv/bin/turnout"
#: A stand-in for values a Secret supplies (``valueFrom``), with the test-secret prefix.
SECRET_STAND_IN = "sk-turnout-test-deploy-secret"

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")


def manifest_files() -> list[Path]:
    """Every Kubernetes manifest, the Secret templates included."""
    return sorted(KUBERNETES.rglob("*.yaml"))


def load_manifest(path: Path) -> list[dict[str, Any]]:
    """The documents of one manifest file (empty documents dropped)."""
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def all_resources() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in manifest_files() for doc in load_manifest(path)]


@dataclass
class Container:
    """One container of a workload, with what its pod says around it."""

    path: Path
    workload: dict[str, Any]
    pod: dict[str, Any]
    spec: dict[str, Any]

    @property
    def id(self) -> str:
        return f"{self.path.stem}/{self.workload['metadata']['name']}/{self.spec['name']}"

    @property
    def is_turnout(self) -> bool:
        """Runs the image of deploy/Dockerfile (its repository's last part is ``turnout``)."""
        repository = self.spec["image"].rsplit(":", 1)[0]
        return repository.rsplit("/", 1)[-1] == "turnout"

    def env(self) -> dict[str, str]:
        """Its environment, with a stand-in for every value taken from elsewhere."""
        return {
            item["name"]: item.get("value", SECRET_STAND_IN) for item in self.spec.get("env") or []
        }

    def ports(self) -> dict[str | int, int]:
        """Declared container ports, by name and by number."""
        ports: dict[str | int, int] = {}
        for port in self.spec.get("ports") or []:
            ports[port["containerPort"]] = port["containerPort"]
            if "name" in port:
                ports[port["name"]] = port["containerPort"]
        return ports

    def mounts(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(mount path, the pod volume it mounts) for each volume mount; a StatefulSet's claim
        templates are volumes too."""
        volumes = {volume["name"]: volume for volume in self.pod.get("volumes") or []}
        for claim in self.workload["spec"].get("volumeClaimTemplates") or []:
            volumes[claim["metadata"]["name"]] = {"persistentVolumeClaim": claim}
        for mount in self.spec.get("volumeMounts") or []:
            assert mount["name"] in volumes, f"{self.id}: mounts undeclared {mount['name']}"
            yield mount["mountPath"], volumes[mount["name"]]


def containers() -> list[Container]:
    """Every container (init containers too) of every workload in the manifests."""
    found = []
    for path, doc in all_resources():
        if doc["kind"] not in WORKLOAD_KINDS:
            continue
        pod = doc["spec"]["template"]["spec"]
        for spec in [*pod.get("initContainers", []), *pod["containers"]]:
            found.append(Container(path, doc, pod, spec))
    return found


def turnout_containers() -> list[Container]:
    return [c for c in containers() if c.is_turnout]


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]  # type: ignore[no-any-return]
    raise AssertionError("turnout has no subcommands")


@functools.cache
def known_env_names(command: str) -> frozenset[str]:
    """The TURNOUT_* variable of every flag ``turnout COMMAND --help`` lists."""
    return frozenset(
        env_name(option)
        for action in subparser(command)._actions
        if not isinstance(action, argparse._HelpAction)
        for option in action.option_strings
        if option.startswith("--")
    )


def parse_turnout(
    argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch, where: str
) -> argparse.Namespace:
    """``turnout ARGV`` as the real parser reads it with exactly ``env``'s TURNOUT_*
    variables; a refused flag or value fails the test, naming ``where``."""
    for name in list(os.environ):
        if name.startswith("TURNOUT_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    unknown = sorted(
        name for name in env if name.startswith("TURNOUT_") and name not in known_env_names(argv[0])
    )
    assert not unknown, f"{where}: `turnout {argv[0]} --help` names no {', '.join(unknown)}"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser().parse_args(argv)
    except SystemExit as exc:
        reason = stderr.getvalue().strip() or str(exc.code)
        pytest.fail(f"{where}: `turnout {' '.join(argv)}` is refused: {reason}")


@dataclass
class Unit:
    """A systemd unit file: its sections' (key, value) lines, keys repeated as written."""

    path: Path
    sections: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> Unit:
        unit = cls(path)
        section: list[tuple[str, str]] = []
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = unit.sections.setdefault(line.strip("[]"), [])
                continue
            key, _, value = line.partition("=")
            section.append((key.strip(), value.strip()))
        return unit

    def values(self, section: str, key: str) -> list[str]:
        return [v for k, v in self.sections.get(section, []) if k == key]

    def value(self, section: str, key: str) -> str:
        found = self.values(section, key)
        assert len(found) == 1, f"{self.path.name}: [{section}] {key}= given {len(found)} times"
        return found[0]


def read_env_file(path: Path) -> dict[str, str]:
    """A systemd EnvironmentFile's KEY=value lines."""
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def seconds(value: str) -> float:
    """A systemd time span such as ``60``, ``5s`` or ``2min``."""
    for suffix, factor in (("min", 60.0), ("ms", 0.001), ("s", 1.0)):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)
