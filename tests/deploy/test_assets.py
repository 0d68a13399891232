"""The deployment assets under deploy/, checked offline against what they name.

- kubernetes/: every manifest passes Kubernetes' own schemas (a pinned version, strict: an
  unknown field fails; the custom resources named in CUSTOM_RESOURCES are checked by their
  own tests instead); every turnout container is read by the real ``turnout`` parser: each
  flag and TURNOUT_* variable it names exists, its values parse, it uses etcd (a null or
  missing ``env:`` falls back to the file store and is caught), and its probes reach the port
  it serves them on. Secrets, disruption budgets, resources and shutdown times are checked
  against each other.
- Dockerfile: its COPY sources, its non-root user, its entrypoint and default command (it
  cannot be built here: no registry for its base images).
- systemd/: ``systemd-analyze verify`` on each unit, and the settings of each unit and of the
  example environment files it reads, through the real parser.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes_validate.utils import all_versions
from tests.certs import TestCa
from tests.deploy.assets import (
    DEPLOY,
    KUBERNETES,
    ROOT,
    SYSTEMD,
    VENV_TURNOUT,
    Container,
    Unit,
    all_resources,
    containers,
    load_manifest,
    manifest_files,
    parse_turnout,
    read_env_file,
    seconds,
    turnout_containers,
)

#: The Kubernetes version the manifests are written for (its schemas ship with
#: kubernetes-validate, pinned in pyproject.toml). 1.30 is the least with the preStop sleep.
KUBERNETES_VERSION = "1.33.0"

CONTAINERS = containers()
TURNOUT = turnout_containers()

#: Custom resources, which Kubernetes' own schemas (all kubernetes-validate ships) cannot
#: validate: each is named here with where its schema lives, and skipped by that check alone.
CUSTOM_RESOURCES = {
    ("keda.sh/v1alpha1", "ScaledObject"): "KEDA's CRD (autoscaling/keda-scaledobject.yaml)",
}


def by_id(items: list[Container]) -> dict[str, Any]:
    return {"argvalues": items, "ids": [c.id for c in items]}


def test_the_pinned_schemas_ship() -> None:
    assert KUBERNETES_VERSION in all_versions()


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_manifest_passes_the_kubernetes_schemas(path: Path) -> None:
    documents = load_manifest(path)
    assert documents, f"{path} holds no resource"
    for doc in documents:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_RESOURCES:
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(part) for part in exc.path)
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {where}: {exc}")


def test_strict_validation_refuses_an_unknown_field() -> None:
    """The check above would pass a misspelt field if the validator were not strict."""
    deployment = next(doc for _, doc in all_resources() if doc["kind"] == "Deployment")
    broken = copy.deepcopy(deployment)
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_custom_resources_are_only_the_named_ones() -> None:
    """A custom resource skips the schema check only by its entry in CUSTOM_RESOURCES."""
    found = {
        (doc["apiVersion"], doc["kind"])
        for _, doc in all_resources()
        if "." in doc["apiVersion"].split("/")[0]
        and not doc["apiVersion"].split("/")[0].endswith(".k8s.io")
    }
    assert found == set(CUSTOM_RESOURCES)


def test_autoscalers_size_a_deployment_to_the_planners_gauge() -> None:
    """The HPA and KEDA's ScaledObject target a Deployment of the manifests, read the
    desired-replicas gauge the metrics-only planner exports, and keep its bounds."""
    resources = [doc for _, doc in all_resources()]
    deployments = {d["metadata"]["name"] for d in resources if d["kind"] == "Deployment"}
    metrics_only = ["planner", "--connector", "metrics-only"]
    (planner,) = [c.env() for c in TURNOUT if c.spec["args"][:3] == metrics_only]
    bounds = (int(planner["TURNOUT_MIN_REPLICAS"]), int(planner["TURNOUT_MAX_REPLICAS"]))
    (hpa,) = [d["spec"] for d in resources if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["scaleTargetRef"]["name"] in deployments
    (metric,) = hpa["metrics"]
    assert metric["external"]["metric"]["name"] == "turnout_planner_desired_replicas"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == bounds
    (scaled,) = [d["spec"] for d in resources if d["kind"] == "ScaledObject"]
    assert scaled["scaleTargetRef"]["name"] in deployments
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "1"
    assert "turnout_planner_desired_replicas{" in trigger["metadata"]["query"]
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == bounds


def test_every_role_has_a_turnout_container() -> None:
    commands = {c.spec["args"][0] for c in TURNOUT}
    assert {"frontend", "worker", "attach", "planner"} <= commands


@pytest.mark.parametrize("container", **by_id(TURNOUT))
def test_turnout_container_flags_and_env_are_turnouts(
    container: Container, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "command" not in container.spec, f"{container.id}: the image's entrypoint is turnout"
    args = parse_turnout(container.spec["args"], container.env(), monkeypatch, container.id)
    assert args.store == "etcd", f"{container.id}: falls back to the {args.store} store"


def test_turnout_containers_share_one_store_and_plane_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frontends refuse instances on other planes: one set for the whole deployment."""
    seen = {}
    for c in TURNOUT:
        args = parse_turnout(c.spec["args"], c.env(), monkeypatch, c.id)
        seen[c.id] = (args.store_endpoints, args.request_plane, args.event_plane, args.nats_url)
    assert len(set(seen.values())) == 1, seen


@pytest.mark.parametrize("container", **by_id(CONTAINERS))
def test_probes_reach_declared_ports(container: Container) -> None:
    ports = container.ports()
    for kind in ("readinessProbe", "livenessProbe"):
        assert kind in container.spec, f"{container.id}: no {kind}"
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.spec.get(kind)
        if probe is None or "exec" in probe:
            continue
        action = probe.get("httpGet") or probe.get("tcpSocket")
        assert action is not None, f"{container.id}: {kind} is neither httpGet, tcpSocket nor exec"
        assert action["port"] in ports, f"{container.id}: {kind} probes undeclared {action['port']}"


@pytest.mark.parametrize("container", **by_id(TURNOUT))
def test_turnout_probes_are_its_health_and_live(
    container: Container, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readiness (and start-up) on the frontend's /ready (this frontend can serve; /health is
    the whole deployment's state) and the workers' and planners' /health, /live for liveness,
    on the port turnout serves them on, bound where the kubelet reaches it."""
    args = parse_turnout(container.spec["args"], container.env(), monkeypatch, container.id)
    if container.spec["args"][0] == "frontend":
        served, host, ready = args.port, args.host, "/ready"
    elif container.spec["args"][0] == "planner":  # its one endpoint: --port
        served, host, ready = args.port, args.host, "/health"
    else:
        served, host, ready = args.system_port, args.system_host, "/health"
    assert host == "0.0.0.0", f"{container.id}: binds {host}, which the kubelet cannot reach"
    ports = container.ports()
    paths = {"startupProbe": ready, "readinessProbe": ready, "livenessProbe": "/live"}
    for kind, path in paths.items():
        probe = container.spec.get(kind)
        if probe is None:
            continue
        assert probe["httpGet"]["path"] == path, f"{container.id}: {kind}"
        assert ports[probe["httpGet"]["port"]] == served, f"{container.id}: {kind} port"


@pytest.mark.parametrize("container", **by_id(CONTAINERS))
def test_resources_and_non_root(container: Container) -> None:
    resources = container.spec.get("resources", {})
    for bound in ("requests", "limits"):
        for what in ("cpu", "memory"):
            assert what in resources.get(bound, {}), f"{container.id}: no {bound}.{what}"
    context = container.spec.get("securityContext", {})
    assert context.get("runAsNonRoot") is True, f"{container.id}: runAsNonRoot"
    assert context.get("allowPrivilegeEscalation") is False, f"{container.id}"
    pod_user = container.pod.get("securityContext", {}).get("runAsUser")
    assert context.get("runAsUser", pod_user) not in (None, 0), f"{container.id}: no uid"
    assert container.pod.get("automountServiceAccountToken") is False, f"{container.id}"


def _pre_stop_seconds(container: Container) -> float:
    pre_stop = container.spec.get("lifecycle", {}).get("preStop")
    assert pre_stop is not None, f"{container.id}: no preStop (endpoints must drop the pod first)"
    return float(pre_stop["sleep"]["seconds"]) if "sleep" in pre_stop else 0.0


@pytest.mark.parametrize("container", **by_id(CONTAINERS))
def test_pre_stop_and_grace(container: Container) -> None:
    pre_stop = _pre_stop_seconds(container)
    grace = container.pod.get("terminationGracePeriodSeconds", 30)
    assert grace > pre_stop, f"{container.id}: the grace period ends within the preStop sleep"


@pytest.mark.parametrize("container", **by_id(TURNOUT))
def test_grace_outlasts_pre_stop_and_drain(
    container: Container, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = parse_turnout(container.spec["args"], container.env(), monkeypatch, container.id)
    drain = float(getattr(args, "drain_timeout", 0.0))
    pre_stop = _pre_stop_seconds(container)
    grace = container.pod["terminationGracePeriodSeconds"]
    assert pre_stop >= 1, f"{container.id}: SIGTERM before the endpoints drop the pod"
    assert grace >= pre_stop + drain + 5, f"{container.id}: killed before its drain ends"


def test_every_workload_has_a_pod_disruption_budget() -> None:
    resources = [doc for _, doc in all_resources()]
    budgets = [doc["spec"]["selector"]["matchLabels"] for doc in resources
               if doc["kind"] == "PodDisruptionBudget"]  # fmt: skip
    for doc in resources:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        labels = doc["spec"]["template"]["metadata"]["labels"]
        selecting = [b for b in budgets if b.items() <= labels.items()]
        assert len(selecting) == 1, f"{doc['metadata']['name']}: {len(selecting)} budgets"


def _secret_templates() -> dict[str, set[str]]:
    return {
        doc["metadata"]["name"]: set(doc.get("stringData", {})) | set(doc.get("data", {}))
        for _, doc in all_resources()
        if doc["kind"] == "Secret"
    }


def _config_maps() -> dict[str, set[str]]:
    return {
        doc["metadata"]["name"]: set(doc["data"])
        for _, doc in all_resources()
        if doc["kind"] == "ConfigMap"
    }


@pytest.mark.parametrize("container", **by_id(CONTAINERS))
def test_named_secrets_and_files_exist(container: Container) -> None:
    """Every secretKeyRef names a Secret of secrets/ and one of its keys; every file a setting
    names under a Secret or ConfigMap mount is one of that object's keys."""
    secrets, config_maps = _secret_templates(), _config_maps()
    for item in container.spec.get("env") or []:
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            assert ref["key"] in secrets.get(ref["name"], set()), f"{container.id}: {ref}"
    mounted: dict[str, set[str]] = {}
    for path, volume in container.mounts():
        if "secret" in volume:
            mounted[path] = secrets.get(volume["secret"]["secretName"], set())
            assert mounted[path], f"{container.id}: no Secret {volume['secret']['secretName']}"
        elif "configMap" in volume:
            mounted[path] = config_maps[volume["configMap"]["name"]]
    values = [v for v in container.env().values()]
    values += [a.partition("=")[2] or a for a in container.spec.get("args", [])]
    for value in values:
        for path, keys in mounted.items():
            if value.startswith(path + "/"):
                name = value[len(path) + 1 :]
                assert name in keys, f"{container.id}: {value}: no key {name} in its volume"


def _replicas(kind: str, name: str) -> int:
    return next(
        doc["spec"]["replicas"]
        for _, doc in all_resources()
        if doc["kind"] == kind and doc["metadata"]["name"] == name
    )


def test_etcd_initial_cluster_names_each_member() -> None:
    (etcd,) = [c for c in CONTAINERS if c.spec["name"] == "etcd"]
    flags = dict(arg.partition("=")[::2] for arg in etcd.spec["args"])
    members = flags["--initial-cluster"].split(",")
    assert members == [
        f"etcd-{i}=https://etcd-{i}.etcd:2380" for i in range(_replicas("StatefulSet", "etcd"))
    ]
    endpoints = {c.env().get("TURNOUT_STORE_ENDPOINTS") for c in TURNOUT}
    assert endpoints == {",".join(m.split("=")[1].replace("2380", "2379") for m in members)}


def _nats_conf() -> str:
    (config,) = [
        d for _, d in all_resources() if d["kind"] == "ConfigMap" and "nats.conf" in d["data"]
    ]
    return str(config["data"]["nats.conf"])


def test_nats_routes_and_clients_name_each_server() -> None:
    servers = [f"nats-{i}.nats" for i in range(_replicas("StatefulSet", "nats"))]
    conf = _nats_conf()
    for server in servers:
        assert f"nats-route://{server}:6222" in conf
    urls = {c.env().get("TURNOUT_NATS_URL") for c in TURNOUT}
    assert urls == {",".join(f"tls://{s}:4222" for s in servers)}
    payload = re.compile(r"^\s*max_payload:\s*(\S+)", re.MULTILINE)
    docs_conf = (DEPLOY / "nats" / "nats-server.conf").read_text()
    assert payload.findall(conf) == payload.findall(docs_conf), "max_payload as the docs' NATS"


@pytest.mark.skipif(shutil.which("nats-server") is None, reason="nats-server is not installed")
def test_nats_config_loads_in_nats_server(tmp_path: Path) -> None:
    """The ConfigMap's nats.conf, with real certificates in place of the Secret's, is accepted
    by ``nats-server -t`` (the variables it reads come from its environment)."""
    ca = TestCa(tmp_path)
    leaf = ca.issue("nats", hosts=("nats-0.nats",))
    conf = _nats_conf()
    for mounted, real in (("tls.crt", leaf.cert), ("tls.key", leaf.key), ("ca.crt", leaf.ca)):
        conf = conf.replace(f"/etc/nats/tls/{mounted}", real)
    path = tmp_path / "nats.conf"
    path.write_text(conf)
    env = {"PATH": "/usr/bin:/usr/sbin:/bin", "POD_NAME": "nats-0",
           "TURNOUT_NATS_PASSWORD": "sk-turnout-test-nats"}  # fmt: skip
    done = subprocess.run(
        ["nats-server", "-c", str(path), "-t"], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        keyword, _, rest = pending.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def _final_stage() -> list[tuple[str, str]]:
    instructions = _dockerfile()
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def test_dockerfile_copies_only_what_the_context_holds() -> None:
    ignored = {
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }  # fmt: skip
    assert {".venv", ".git"} <= ignored
    copies = [rest.split() for keyword, rest in _dockerfile() if keyword == "COPY"]
    assert copies
    for words in copies:
        if any(word.startswith("--from=") for word in words):
            continue
        sources = [word for word in words if not word.startswith("--")][:-1]
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert source.split("/")[0] not in ignored, f"COPY {source}: .dockerignore drops it"


def test_image_runs_turnout_as_a_fixed_non_root_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    final = dict(_final_stage())
    uid = final["USER"].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {final['USER']}: a number, not root"
    pod_uids = {c.pod["securityContext"]["runAsUser"] for c in TURNOUT}
    assert pod_uids == {int(uid)}, "the turnout pods run as the image's user"
    with (ROOT / "pyproject.toml").open("rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    entrypoint = json.loads(final["ENTRYPOINT"])
    assert entrypoint == ["turnout"] and "turnout" in scripts
    assert f"COPY --from=builder {Path(VENV_TURNOUT).parents[1]} " in "\n".join(
        f"{keyword} {rest}" for keyword, rest in _final_stage()
    ), "the image's venv is where the systemd units run turnout from"
    command = json.loads(final["CMD"])
    args = parse_turnout(command, {}, monkeypatch, "Dockerfile CMD")
    assert command[0] == "serve" and args.host == "0.0.0.0"
    assert str(args.port) in final["EXPOSE"].split()


UNITS = sorted(SYSTEMD.glob("*.service"))
#: What `systemd-analyze verify` says of a unit where turnout is not installed.
NOT_INSTALLED = re.compile(
    rf"^\S+\.service: Command {re.escape(VENV_TURNOUT)} is not executable: "
    "No such file or directory$"
)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_unit_passes_systemd_analyze_verify(path: Path) -> None:
    done = subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60
    )
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    tolerated = [] if Path(VENV_TURNOUT).exists() else [s for s in said if NOT_INSTALLED.match(s)]
    assert said == tolerated, "\n".join(said)
    assert done.returncode == (1 if tolerated else 0)


def _unit_env(unit: Unit) -> list[dict[str, str]]:
    """The environments the unit runs under: its files' examples in order, one environment
    per example of an instance's file (``%i``)."""
    envs: list[dict[str, str]] = [{}]
    for value in unit.values("Service", "EnvironmentFile"):
        name = Path(value.lstrip("-")).name
        examples = sorted(SYSTEMD.glob(name.replace("%i", "*")))
        assert examples, f"{unit.path.name}: no example of {value} in deploy/systemd"
        envs = [{**env, **read_env_file(example)} for env in envs for example in examples]
    return envs


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_unit_settings(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    unit = Unit.read(path)
    command = unit.value("Service", "ExecStart").split()
    assert command[0] == VENV_TURNOUT
    assert unit.value("Service", "User") not in ("", "root")
    assert unit.value("Service", "Restart") == "on-failure"
    assert unit.value("Service", "KillSignal") == "SIGTERM"
    assert unit.value("Unit", "StartLimitIntervalSec") == "0", "a restart loop never gives up"
    assert unit.value("Service", "NoNewPrivileges") == "yes"
    assert unit.value("Service", "ProtectSystem") == "strict"
    for env in _unit_env(unit):
        args = parse_turnout(command[1:], env, monkeypatch, path.name)
        assert args.store == "etcd", f"{path.name}: falls back to the {args.store} store"
        drain = float(getattr(args, "drain_timeout", 0.0))
        assert seconds(unit.value("Service", "TimeoutStopSec")) >= drain + 5


def test_units_share_one_store_and_plane_set(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = set()
    for path in UNITS:
        unit = Unit.read(path)
        command = unit.value("Service", "ExecStart").split()[1:]
        for env in _unit_env(unit):
            args = parse_turnout(command, env, monkeypatch, path.name)
            seen.add((args.store_endpoints, args.request_plane, args.event_plane))
    assert len(seen) == 1, seen


def test_every_environment_example_belongs_to_a_unit() -> None:
    patterns = [
        Path(value.lstrip("-")).name.replace("%i", "*")
        for path in UNITS
        for value in Unit.read(path).values("Service", "EnvironmentFile")
    ]
    for example in sorted(SYSTEMD.glob("*.env")):
        assert any(fnmatch.fnmatch(example.name, p) for p in patterns), f"{example.name}: no unit"
