"""The kubernetes connector against a recorded fake Kubernetes API server.

No API server can run on these machines (no kube-apiserver binary, no cluster, no network to
fetch one), so this is a recorded fake: a real HTTP server on a socket, in a thread, answering
``GET`` and ``PATCH`` on ``/apis/apps/v1/namespaces/NS/deployments/NAME/scale`` with the
objects the API server documents (an ``autoscaling/v1`` Scale; a ``v1`` Status on failure)
and recording every request. What is checked is what crosses the wire: the request
``kubectl scale deployment/NAME --replicas=N -n NS`` sends (kubectl pkg/scale/scale.go and
client-go scale/client.go: a merge patch of the scale subresource), the credentials of a
kubeconfig or of a pod's service account, and failures turned into one clear line.
"""

from __future__ import annotations

import importlib
import json
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes.config import incluster_config
from prometheus_client import CollectorRegistry
from tests.certs import TestCa

from turnout.planner.connectors.base import ConnectorError
from turnout.planner.connectors.kubernetes import KubernetesConnector
from turnout.planner.connectors.metrics_only import MetricsOnlyConnector, desired_replicas_gauge

#: PyYAML ships no type information (and the stubs are not a dependency): imported as Any.
yaml: Any = importlib.import_module("yaml")

ROOT = Path(__file__).resolve().parents[2]
PLANNER_MANIFEST = ROOT / "deploy" / "kubernetes" / "planner.yaml"
NS = "serving"
TOKEN = "sk-turnout-test-kube-token"
SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
#: How long a request to the hanging server may wait for the test to let it go.
HANG_BOUND = 30.0


@dataclass(frozen=True)
class Recorded:
    """One request as the fake server received it."""

    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: bytes


@dataclass
class FakeApiServer:
    """Deployments by (namespace, name) with their replicas; ``forbidden`` (namespace, name,
    verb) answer 403 as RBAC would; ``hang`` holds every request until ``release``."""

    url: str = ""
    token: str = TOKEN
    deployments: dict[tuple[str, str], int] = field(default_factory=dict)
    forbidden: set[tuple[str, str, str]] = field(default_factory=set)
    hang: bool = False
    release: threading.Event = field(default_factory=threading.Event)
    requests: list[Recorded] = field(default_factory=list)

    def scale_object(self, namespace: str, name: str) -> dict[str, Any]:
        replicas = self.deployments[(namespace, name)]
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": "5b1f3c1e-8e0a-4f7e-9a53-0d6c2b1f7a10",
                "resourceVersion": str(1000 + len(self.requests)),
                "creationTimestamp": "2026-01-05T10:00:00Z",
            },
            "spec": {"replicas": replicas},
            "status": {"replicas": replicas, "selector": f"app.kubernetes.io/name={name}"},
        }


def status(code: int, reason: str, message: str, name: str = "") -> dict[str, Any]:
    """A ``v1`` Status, as the API server answers a failed request."""
    details = {"name": name, "group": "apps", "kind": "deployments"} if name else {}
    return {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "details": details, "code": code,
    }  # fmt: skip


def make_handler(fake: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return None

        def _answer(self, code: int, doc: dict[str, Any]) -> None:
            payload = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            fake.requests.append(Recorded(self.command, self.path, headers, body))
            if fake.hang:
                fake.release.wait(HANG_BOUND)
                return
            # As the API server's bearer authenticator: the scheme in any case.
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or token != fake.token:
                self._answer(401, status(401, "Unauthorized", "Unauthorized"))
                return
            parts = self.path.split("?")[0].strip("/").split("/")
            # apis apps v1 namespaces NS deployments NAME scale
            if len(parts) != 8 or parts[:3] != ["apis", "apps", "v1"] or parts[7] != "scale":
                self._answer(404, status(404, "NotFound", "the server could not find it"))
                return
            namespace, name = parts[4], parts[6]
            verb = {"GET": "get", "PATCH": "patch"}.get(self.command, "")
            if (namespace, name, verb) in fake.forbidden:
                user = f"system:serviceaccount:{namespace}:turnout-planner"
                message = (
                    f'deployments.apps "{name}" is forbidden: User "{user}" cannot {verb} '
                    f'resource "deployments/scale" in API group "apps" in the namespace '
                    f'"{namespace}"'
                )
                self._answer(403, status(403, "Forbidden", message, name))
                return
            if (namespace, name) not in fake.deployments:
                message = f'deployments.apps "{name}" not found'
                self._answer(404, status(404, "NotFound", message, name))
                return
            if verb == "patch":
                if headers.get("content-type") != "application/merge-patch+json":
                    self._answer(415, status(415, "UnsupportedMediaType", "only merge-patch"))
                    return
                patch = json.loads(body)
                fake.deployments[(namespace, name)] = int(patch["spec"]["replicas"])
            self._answer(200, fake.scale_object(namespace, name))

        do_GET = _handle
        do_PATCH = _handle

    return Handler


@pytest.fixture
def fake_api() -> Iterator[FakeApiServer]:
    yield from _serve(None)


def _serve(tls: ssl.SSLContext | None) -> Iterator[FakeApiServer]:
    fake = FakeApiServer(deployments={(NS, "turnout-worker"): 2})
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(fake))
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    scheme = "https" if tls is not None else "http"
    fake.url = f"{scheme}://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        fake.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def write_kubeconfig(path: Path, server: str, *, namespace: str | None = NS) -> Path:
    context: dict[str, str] = {"cluster": "fake", "user": "planner"}
    if namespace is not None:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "planner", "user": {"token": TOKEN}}],
        "contexts": [{"name": "fake", "context": context}],
    }  # fmt: skip
    path.write_text(json.dumps(config))  # JSON is YAML: the kubeconfig loader reads it
    return path


@pytest.fixture
def kubeconfig(fake_api: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kubeconfig for the fake server (token, namespace); no pod environment around."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    return str(write_kubeconfig(tmp_path / "kubeconfig", fake_api.url))


def connector(kubeconfig: str, **kwargs: Any) -> KubernetesConnector:
    return KubernetesConnector({"aggregated": "turnout-worker"}, kubeconfig=kubeconfig, **kwargs)


async def test_start_reads_the_scale_with_the_kubeconfigs_token_and_namespace(
    fake_api: FakeApiServer, kubeconfig: str
) -> None:
    k8s = connector(kubeconfig)
    await k8s.start()
    try:
        assert k8s.namespace == NS
        assert await k8s.replicas("aggregated") == 2
        fake_api.deployments[(NS, "turnout-worker")] = 5
        assert await k8s.replicas("aggregated") == 5
    finally:
        await k8s.close(stop_workers=True)
    path = SCALE_PATH.format(ns=NS, name="turnout-worker")
    assert [(r.method, r.path) for r in fake_api.requests] == [("GET", path)] * 3
    assert {r.headers["authorization"] for r in fake_api.requests} == {f"Bearer {TOKEN}"}


async def test_scale_sends_what_kubectl_scale_sends(
    fake_api: FakeApiServer, kubeconfig: str
) -> None:
    """``kubectl scale deployment/turnout-worker --replicas=3 -n serving``: a merge patch of
    the scale subresource, ``{"spec":{"replicas":3}}``, no query parameters."""
    k8s = connector(kubeconfig)
    await k8s.start()
    try:
        await k8s.scale("aggregated", 3, drain_first=[7, 8])
    finally:
        await k8s.close(stop_workers=True)
    patch = fake_api.requests[-1]
    assert patch.method == "PATCH"
    assert patch.path == f"/apis/apps/v1/namespaces/{NS}/deployments/turnout-worker/scale"
    assert patch.headers["content-type"] == "application/merge-patch+json"
    assert patch.headers["authorization"] == f"Bearer {TOKEN}"
    assert patch.headers["accept"] == "application/json"
    assert json.loads(patch.body) == {"spec": {"replicas": 3}}
    # kubectl's bytes (Go's json.Marshal), but for the client's insignificant spaces: one
    # JSON object, not a JSON string holding one, nor a list of JSON-patch operations.
    assert patch.body.replace(b" ", b"") == b'{"spec":{"replicas":3}}'
    assert fake_api.deployments[(NS, "turnout-worker")] == 3


async def test_close_never_scales(fake_api: FakeApiServer, kubeconfig: str) -> None:
    k8s = connector(kubeconfig)
    await k8s.start()
    await k8s.close(stop_workers=True)
    assert {r.method for r in fake_api.requests} == {"GET"}
    assert fake_api.deployments[(NS, "turnout-worker")] == 2


async def test_a_missing_deployment_fails_start_naming_it(
    fake_api: FakeApiServer, kubeconfig: str
) -> None:
    k8s = KubernetesConnector(
        {"prefill": "turnout-worker", "decode": "turnout-decode"}, kubeconfig=kubeconfig
    )
    with pytest.raises(ConnectorError) as raised:
        await k8s.start()
    await k8s.close(stop_workers=False)
    message = str(raised.value)
    assert "\n" not in message
    assert f"Deployment {NS}/turnout-decode (decode pool)" in message
    assert "404 Not Found" in message and 'deployments.apps "turnout-decode" not found' in message


@pytest.mark.parametrize("verb", ["get", "patch"])
async def test_forbidden_names_rbac(fake_api: FakeApiServer, kubeconfig: str, verb: str) -> None:
    fake_api.forbidden.add((NS, "turnout-worker", verb))
    k8s = connector(kubeconfig)
    try:
        with pytest.raises(ConnectorError) as raised:
            await k8s.start()
            await k8s.scale("aggregated", 4, drain_first=[])
    finally:
        await k8s.close(stop_workers=False)
    message = str(raised.value)
    assert "403 Forbidden" in message and "turnout-worker" in message
    assert f"RBAC: the planner's service account may not {verb} deployments/scale" in message


async def test_an_api_server_that_does_not_answer_times_out(
    fake_api: FakeApiServer, kubeconfig: str
) -> None:
    fake_api.hang = True
    k8s = connector(kubeconfig, timeout=0.5)
    began = time.monotonic()
    with pytest.raises(ConnectorError) as raised:
        await k8s.start()
    elapsed = time.monotonic() - began
    await k8s.close(stop_workers=False)
    assert elapsed < 5.0, f"the connector waited {elapsed:.1f}s on a 0.5s deadline"
    assert "did not answer within 0.5s" in str(raised.value)
    assert len(fake_api.requests) == 1, "one attempt: no retry multiplies the wait"


async def test_a_refused_connection_is_a_connector_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    path = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:9")  # discard: closed
    k8s = connector(str(path), timeout=2.0)
    with pytest.raises(ConnectorError) as raised:
        await k8s.start()
    assert "turnout-worker" in str(raised.value)
    assert "cannot reach the API server" in str(raised.value)
    await k8s.close(stop_workers=False)


async def test_a_bad_token_is_refused_credentials(fake_api: FakeApiServer, kubeconfig: str) -> None:
    fake_api.token = "another"
    k8s = connector(kubeconfig)
    with pytest.raises(ConnectorError, match="401 Unauthorized: the API server refused"):
        await k8s.start()
    await k8s.close(stop_workers=False)


async def test_namespace_given_beats_the_context_and_default_is_default(
    fake_api: FakeApiServer, kubeconfig: str, tmp_path: Path
) -> None:
    fake_api.deployments[("other", "turnout-worker")] = 1
    fake_api.deployments[("default", "turnout-worker")] = 6
    given = connector(kubeconfig, namespace="other")
    await given.start()
    assert await given.replicas("aggregated") == 1
    await given.close(stop_workers=False)
    bare = write_kubeconfig(tmp_path / "bare", fake_api.url, namespace=None)
    fallback = connector(str(bare))
    await fallback.start()
    assert fallback.namespace == "default"
    assert await fallback.replicas("aggregated") == 6
    await fallback.close(stop_workers=False)


async def test_without_a_kubeconfig_flag_it_reads_the_kubeconfig_variable(
    fake_api: FakeApiServer, kubeconfig: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    k8s = KubernetesConnector({"aggregated": "turnout-worker"})
    await k8s.start()
    await k8s.close(stop_workers=False)
    assert k8s.namespace == NS and len(fake_api.requests) == 1


async def test_a_missing_kubeconfig_fails_start(tmp_path: Path) -> None:
    k8s = connector(str(tmp_path / "absent"))
    with pytest.raises(ConnectorError, match="cannot load the kubeconfig"):
        await k8s.start()


@pytest.fixture
def in_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApiServer]:
    """A pod's view: KUBERNETES_SERVICE_HOST/PORT, and the service account's token, CA and
    namespace files (where the client's constants say; pointed at tmp_path), the fake API
    server serving TLS with a certificate that CA signed."""
    ca = TestCa(tmp_path, "cluster")
    leaf = ca.issue("kubernetes")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(leaf.cert, leaf.key)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(TOKEN)
    (account / "ca.crt").write_text(Path(leaf.ca).read_text())
    (account / "namespace").write_text(NS)
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(account / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(account / "ca.crt"))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    for fake in _serve(context):
        host, port = fake.url.removeprefix("https://").split(":")
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
        yield fake


async def test_in_a_pod_it_uses_the_service_account(in_cluster: FakeApiServer) -> None:
    k8s = KubernetesConnector({"aggregated": "turnout-worker"})
    await k8s.start()
    try:
        assert k8s.namespace == NS
        await k8s.scale("aggregated", 1, drain_first=[])
    finally:
        await k8s.close(stop_workers=True)
    assert in_cluster.deployments[(NS, "turnout-worker")] == 1
    assert {r.headers["authorization"].lower() for r in in_cluster.requests} == {f"bearer {TOKEN}"}


def _role_grants() -> set[tuple[str, str, str, str]]:
    """(verb, API group, resource, name) of every permission planner.yaml's Role grants."""
    (role,) = [
        doc for doc in yaml.safe_load_all(PLANNER_MANIFEST.read_text())
        if doc and doc["kind"] == "Role"
    ]  # fmt: skip
    grants = set()
    for rule in role["rules"]:
        assert rule.get("resourceNames"), "the Role names the Deployments it may touch"
        for verb in rule["verbs"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for name in rule["resourceNames"]:
                        grants.add((verb, group, resource, name))
    return grants


def _planner_deployments() -> dict[str, str]:
    """The --deployment POOL=NAME arguments of planner.yaml's planner container."""
    docs = [d for d in yaml.safe_load_all(PLANNER_MANIFEST.read_text()) if d]
    (planner,) = [d for d in docs if d["kind"] == "Deployment"]
    args = planner["spec"]["template"]["spec"]["containers"][0]["args"]
    named = [args[i + 1] for i, arg in enumerate(args) if arg == "--deployment"]
    return dict(entry.split("=", 1) for entry in named)


async def test_the_planner_role_grants_exactly_what_the_connector_calls(
    fake_api: FakeApiServer, kubeconfig: str
) -> None:
    """Every request start, replicas and scale make, as RBAC names it, against the Role of
    deploy/kubernetes/planner.yaml: nothing missing (a 403 at start), nothing more."""
    deployments = _planner_deployments()
    for name in deployments.values():
        fake_api.deployments[(NS, name)] = 1
    k8s = KubernetesConnector(deployments, kubeconfig=kubeconfig)
    await k8s.start()
    try:
        for pool in deployments:
            await k8s.replicas(pool)
            await k8s.scale(pool, 2, drain_first=[])
    finally:
        await k8s.close(stop_workers=True)
    called = set()
    for request in fake_api.requests:
        # /apis/GROUP/VERSION/namespaces/NS/RESOURCE/NAME[/SUBRESOURCE]
        parts = request.path.split("?")[0].strip("/").split("/")
        resource = "/".join([parts[5], *parts[7:]])
        called.add(({"GET": "get", "PATCH": "patch"}[request.method], parts[1], resource, parts[6]))
    assert called == _role_grants()


async def test_metrics_only_sets_the_desired_replicas_gauge() -> None:
    registry = CollectorRegistry()
    metrics = MetricsOnlyConnector(desired_replicas_gauge(registry))
    await metrics.start()
    assert await metrics.replicas("decode") is None
    await metrics.scale("decode", 4, drain_first=[1])
    await metrics.scale("prefill", 2, drain_first=[])
    await metrics.scale("decode", 3, drain_first=[])
    await metrics.close(stop_workers=True)
    value = registry.get_sample_value
    assert value("turnout_planner_desired_replicas", {"pool": "decode"}) == 3
    assert value("turnout_planner_desired_replicas", {"pool": "prefill"}) == 2
