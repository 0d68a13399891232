"""``kubernetes``: each pool is a Deployment, sized through its ``scale`` subresource.

The planner reads and writes only ``deployments/scale`` (``get`` and ``patch``), which is all
its Role grants (deploy/kubernetes/planner.yaml). A scale change is the request
``kubectl scale deployment/NAME --replicas=N -n NS`` sends: kubectl's ``genericScaler.ScaleSimple``
(kubernetes/kubectl pkg/scale/scale.go, no precondition given) marshals
``{"spec":{"replicas":N}}`` and patches it with ``types.MergePatchType``, and client-go's
``namespacedScaleClient.Patch`` (kubernetes/client-go scale/client.go) sends it as
``PATCH /apis/apps/v1/namespaces/NS/deployments/NAME/scale``, ``Content-Type:
application/merge-patch+json``. (kubectl also GETs the Deployment first, to resolve its
arguments; the planner already knows the name.) Kubernetes then picks the pods to remove; a
worker drains on the SIGTERM its pod receives.

The official client is synchronous: each call runs in a worker thread with the client's own
deadline (``_request_timeout``) and no retry (the planner tries again at its next decision),
so an API server that does not answer costs one ``timeout``, never a hung planner.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.config import incluster_config, kube_config
from kubernetes.config.config_exception import ConfigException

from turnout.planner.connectors.base import ConnectorError

log = logging.getLogger("turnout.planner")

#: The patch ``kubectl scale`` sends (types.MergePatchType); the client would otherwise pick
#: a strategic merge patch.
MERGE_PATCH = "application/merge-patch+json"
DEFAULT_NAMESPACE = "default"


def _in_cluster_namespace_file() -> Path:
    """The service account's namespace file, beside its token (read from the client's
    constant at call time, so a test can point it elsewhere)."""
    return Path(incluster_config.SERVICE_TOKEN_FILENAME).with_name("namespace")


def _status_message(exc: client.ApiException) -> str:
    """The API server's one-line reason (its Status object's ``message``), else the body."""
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else exc.body
    try:
        message = json.loads(body or "")["message"]
    except (ValueError, KeyError, TypeError):
        message = (body or "").strip()
    return " ".join(str(message).split())[:300]


class KubernetesConnector:
    """Sizes each pool's Deployment through its scale subresource (see the module docstring).

    ``deployments`` maps a pool (``aggregated``, ``prefill``, ``decode``) to the Deployment
    that runs its workers. Credentials: ``kubeconfig`` if given; else the pod's service
    account when running in a pod (``KUBERNETES_SERVICE_HOST`` set); else the default
    kubeconfig (``$KUBECONFIG`` or ~/.kube/config). ``namespace`` defaults to the pod's
    namespace, else the kubeconfig context's, else ``default``.
    """

    name = "kubernetes"

    def __init__(
        self,
        deployments: dict[str, str],
        *,
        namespace: str | None = None,
        kubeconfig: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        self._deployments = dict(deployments)
        self._namespace = namespace
        self._kubeconfig = kubeconfig
        self._timeout = timeout
        self._api_client: client.ApiClient | None = None
        self._apps: client.AppsV1Api | None = None

    @property
    def namespace(self) -> str | None:
        """The Deployments' namespace (known once started, or when given)."""
        return self._namespace

    def _configure(self) -> client.Configuration:
        """Load credentials (blocking: reads files, may run a kubeconfig's exec plugin)."""
        configuration = client.Configuration()
        in_cluster = self._kubeconfig is None and bool(
            os.environ.get(incluster_config.SERVICE_HOST_ENV_NAME)
        )
        try:
            if in_cluster:
                incluster_config.InClusterConfigLoader(
                    token_filename=incluster_config.SERVICE_TOKEN_FILENAME,
                    cert_filename=incluster_config.SERVICE_CERT_FILENAME,
                ).load_and_set(configuration)
                namespace_file = _in_cluster_namespace_file()
                found = namespace_file.read_text().strip() if namespace_file.is_file() else ""
            else:
                # $KUBECONFIG may list several files (merged as kubectl does).
                path = self._kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
                kube_config.load_kube_config(
                    config_file=path, client_configuration=configuration, persist_config=False
                )
                _, context = kube_config.list_kube_config_contexts(config_file=path)
                found = str((context or {}).get("context", {}).get("namespace") or "")
        except (ConfigException, OSError, ValueError) as exc:
            where = "the pod's service account" if in_cluster else "the kubeconfig"
            raise ConnectorError(f"kubernetes: cannot load {where}: {exc}") from exc
        if self._namespace is None:
            self._namespace = found or DEFAULT_NAMESPACE
        # One attempt a call: a retry after a timeout would multiply the planner's wait.
        configuration.retries = urllib3.Retry(0, read=False, redirect=0)
        return configuration

    async def start(self) -> None:
        """Load credentials and read every Deployment's scale: a missing Deployment or a Role
        that does not grant ``get`` on ``deployments/scale`` fails here, named."""
        configuration = await asyncio.to_thread(self._configure)
        self._api_client = client.ApiClient(configuration)
        self._apps = client.AppsV1Api(self._api_client)
        for pool in self._deployments:
            replicas = await self.replicas(pool)
            log.info(
                "pool %s is Deployment %s/%s, %s replicas", pool, self._namespace,
                self._deployments[pool], replicas,
            )  # fmt: skip

    def _deployment(self, pool: str) -> str:
        try:
            return self._deployments[pool]
        except KeyError:
            raise ConnectorError(f"kubernetes: no Deployment for the {pool} pool") from None

    async def _call(self, pool: str, what: str, verb: str, call: Any, **kwargs: Any) -> Any:
        """``call(name, namespace, **kwargs)`` in a thread under the deadline; every failure
        becomes one ConnectorError line naming the Deployment and the status."""
        name = self._deployment(pool)
        where = f"Deployment {self._namespace}/{name} ({pool} pool): {what}"
        try:
            return await asyncio.to_thread(
                call, name, self._namespace, _request_timeout=self._timeout, **kwargs
            )
        except client.ApiException as exc:
            status = f"{exc.status} {exc.reason}"
            message = _status_message(exc)
            if exc.status == 404:
                hint = "no such Deployment in this namespace"
            elif exc.status == 403:
                hint = (
                    f"RBAC: the planner's service account may not {verb} deployments/scale "
                    f"in namespace {self._namespace}"
                )
            elif exc.status == 401:
                hint = "the API server refused the credentials"
            else:
                hint = ""
            detail = "; ".join(part for part in (hint, message) if part)
            raise ConnectorError(f"{where}: {status}: {detail}") from exc
        except urllib3.exceptions.HTTPError as exc:
            cause = exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) else exc
            # NewConnectionError (refused, no route) is a ConnectTimeoutError to urllib3.
            timed_out = isinstance(cause, urllib3.exceptions.TimeoutError) and not isinstance(
                cause, urllib3.exceptions.NewConnectionError
            )
            if timed_out:
                problem = f"the API server did not answer within {self._timeout:g}s"
            else:
                problem = f"cannot reach the API server ({type(cause).__name__}: {cause})"
            raise ConnectorError(f"{where}: {problem}") from exc

    async def replicas(self, pool: str) -> int | None:
        """The Deployment's ``spec.replicas`` as its scale subresource reports it."""
        scale = await self._call(
            pool, "reading its scale", "get", self._apps_api().read_namespaced_deployment_scale
        )
        return int(scale.spec.replicas or 0) if scale.spec is not None else 0

    async def scale(self, pool: str, replicas: int, *, drain_first: list[int]) -> None:
        """Set the Deployment's replicas as ``kubectl scale`` does (a merge patch of the scale
        subresource, see the module docstring).

        ``drain_first`` is ignored: the ReplicaSet controller picks the pods to delete (not
        ready first, then the newest), and each worker drains on its pod's SIGTERM. To steer
        it, annotate worker pods with ``controller.kubernetes.io/pod-deletion-cost`` (lower
        goes first); this connector does not, as that would need ``patch`` on pods.
        """
        await self._call(
            pool, f"scaling to {replicas}", "patch",
            self._apps_api().patch_namespaced_deployment_scale,
            body={"spec": {"replicas": replicas}}, _content_type=MERGE_PATCH,
        )  # fmt: skip
        log.info("scaled Deployment %s/%s to %d", self._namespace, self._deployment(pool), replicas)

    def _apps_api(self) -> client.AppsV1Api:
        if self._apps is None:
            raise ConnectorError("kubernetes: the connector is not started")
        return self._apps

    async def close(self, *, stop_workers: bool) -> None:
        """Release the HTTP connections. Never scales anything: the Deployments are the
        operator's, and outlive the planner (``stop_workers`` does not apply)."""
        api_client, self._api_client, self._apps = self._api_client, None, None
        if api_client is not None:
            await asyncio.to_thread(api_client.close)
