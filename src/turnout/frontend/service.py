"""The frontend process: runtime + model watcher + HTTP server, with a clean lifecycle.

Security: with ``api_keys``, ``api_keys_file`` or ``jwt`` set, callers need a credential
(``access.authenticator``), and ``SIGHUP`` reloads the keys and JWKS files; with
``tls_cert``/``tls_key`` the HTTP server speaks HTTPS only. A frontend bound to an address
other than loopback with no credentials says so in one warning line at start.

Drain (``drain``, on SIGTERM): readiness goes first (``/health`` answers 503 with
``"status": "draining"``), new generation requests are refused with a 503 in OpenAI's shape
(``service_unavailable``, ``Retry-After``) while those in flight finish, and the listener
closes once none is left or after ``drain_timeout`` seconds (``stop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import signal
import socket
import ssl
from dataclasses import dataclass, field

from turnout.errors import ConfigError, TurnoutError
from turnout.frontend.access.authenticator import Authenticator
from turnout.frontend.access.cache_space import CacheSpaces
from turnout.frontend.access.jwt import JwtConfig
from turnout.frontend.access.limits import TenantLimits
from turnout.frontend.access.usage import TenantUsage
from turnout.frontend.admission.busy_threshold import BusyThresholds
from turnout.frontend.admission.limiter import AdmissionController, AdmissionLimits, Clock
from turnout.frontend.dashboard.fleet import FleetView
from turnout.frontend.dashboard.history import LatencyHistory
from turnout.frontend.dashboard.routes import DashboardRoutes
from turnout.frontend.http.access_gate import PUBLIC_ROUTE_CHOICES
from turnout.frontend.http.app import DEFAULT_MAX_BODY_BYTES, HttpService
from turnout.frontend.http.errors import REJECT_STATUSES
from turnout.frontend.http.scrape_targets import ScrapeTargetRoutes
from turnout.frontend.metrics.affinity import SessionAffinityCollector
from turnout.frontend.metrics.disagg import DisaggMetrics
from turnout.frontend.metrics.frontend import FrontendMetrics
from turnout.frontend.metrics.prompt_cache import PromptCacheCollector
from turnout.frontend.models.artifacts import ArtifactFetcher, DiskArtifactCache
from turnout.frontend.models.factory import PipelineFactory
from turnout.frontend.models.lora import LoraModels
from turnout.frontend.models.manager import ModelManager
from turnout.frontend.models.watcher import ModelWatcher
from turnout.frontend.responses.history import (
    DEFAULT_MAX_RECORD_BYTES,
    DEFAULT_TTL_S,
    ResponseHistory,
)
from turnout.frontend.responses.store import DEFAULT_RESPONSE_STORE, make_response_store
from turnout.llm.limits import RequestLimits
from turnout.llm.prompt_cache import DEFAULT_MAX_BYTES, PromptCache
from turnout.protocols.card_bounds import DEFAULT_MAX_ARTIFACT_BYTES
from turnout.router.kv.config import KvRouterConfig
from turnout.router.lora import LoraRegistry
from turnout.router.mode import RouterMode, validate_router_mode_for_lora
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.http import HttpLimits, HttpServer
from turnout.runtime.planes import PlanesConfig, open_runtime
from turnout.runtime.process_metrics import StoreContactCollector

log = logging.getLogger("turnout.frontend")

#: Longest pause between two sweeps of the response store's expired records.
SWEEP_INTERVAL_S = 60.0


@dataclass(slots=True)
class FrontendConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    #: Discovery store, request and event planes, addresses, leases.
    planes: PlanesConfig = field(default_factory=PlanesConfig)
    namespace: str | None = None
    router_mode: RouterMode = RouterMode.ROUND_ROBIN
    migration_limit: int = 3
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: What one request may ask for: stop strings, messages, tools, choices, the response's
    #: size (``llm.limits``; the ``--max-*`` flags).
    limits: RequestLimits = field(default_factory=RequestLimits)
    #: Deadlines and bounds of client connections (``runtime.http.HttpLimits``): headers,
    #: body, keep-alive idle, a client that stops reading, and the connection cap.
    http: HttpLimits = field(default_factory=HttpLimits)
    #: KV routing settings (``--router-mode kv``); ``block_size`` comes from each model card.
    kv: KvRouterConfig = field(default_factory=KvRouterConfig)
    #: Share in-flight request state with other router replicas over the event plane.
    kv_share_active: bool = True
    #: A model answers 503 until this many of its instances have been up (0 or 1: at once).
    router_min_initial_workers: int = 0
    #: Where fetched model artifacts are cached on disk (``off``: nowhere; None: what
    #: ``$TURNOUT_ARTIFACT_CACHE`` says, else ``~/.cache/turnout/artifacts``).
    artifact_cache: str | None = None
    #: The largest artifact a model card may name (``--max-artifact-bytes``): a card
    #: announcing more is refused, an instance sending more is cut off mid-stream.
    max_artifact_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES
    #: The bound of the cache of chat prompts' pieces' token ids (``llm.prompt_cache``),
    #: shared by every model; 0 turns it off.
    prompt_cache_bytes: int = DEFAULT_MAX_BYTES
    #: Admission: requests in flight frontend-wide and per model (0: unlimited), and the
    #: bounded priority queue of those waiting for a slot (see ``admission``).
    max_inflight: int = 1024
    max_inflight_per_model: int = 0
    queue_size: int = 1024
    queue_timeout: float = 30.0
    #: Status of admission rejections: 429, 503 or 529 (Dynamo's), with ``Retry-After``.
    reject_status: int = 503
    #: Seconds a request may take in all, migrations included (0: no deadline); a request's
    #: ``nvext.request_timeout`` overrides it. Past it: 504 (an SSE error once streaming).
    request_timeout: float = 0.0
    #: Seconds an attempt may wait for its first output, and between outputs, before its
    #: worker counts as stalled and the request migrates (0: no limit).
    ttft_timeout: float = 0.0
    stall_timeout: float = 0.0
    #: Session affinity: a session (``x-session-id``) stays on the instance that served its
    #: first request while it has requests in flight and this many idle seconds after
    #: (None: off; see ``router.session_affinity``).
    router_session_affinity_ttl_s: float | None = None
    #: Serve LoRA adapters by name, routed to the instances that hold them
    #: (``frontend.models.lora``).
    enable_lora: bool = False
    #: ``device-aware-weighted``: how many CPU instances one GPU instance is worth (Dynamo's
    #: ``non_cpu_to_cpu_ratio``, default 8; see ``router.load_selectors``).
    router_cpu_gpu_ratio: int = 8
    #: Disaggregated serving: prompts with fewer tokens not cached on their decode worker
    #: skip the prefill stage (``router.prefill_router``).
    prefill_min_tokens: int = 512
    #: With no prefill worker, decode workers serve whole requests; when off, requests of a
    #: decode-role model wait (bounded) for a prefill worker, then fail with 503.
    decode_fallback: bool = True
    #: The Responses API's store (``--response-store``): ``sqlite:PATH`` (``sqlite:``: the
    #: default file, ``responses.store.sqlite.default_sqlite_path``), ``postgres://...``,
    #: ``redis://...`` (shared by several frontends), ``memory:`` or ``off``.
    response_store: str = DEFAULT_RESPONSE_STORE
    #: Seconds a stored response or conversation lives after its chain's (or its) last write.
    response_store_ttl: float = DEFAULT_TTL_S
    #: The largest record stored (one response's input items and body); a larger response is
    #: answered but not stored (``store: false``).
    response_store_max_bytes: int = DEFAULT_MAX_RECORD_BYTES
    #: API keys (``--api-key``: tenant ``default``), the keys file (``--api-keys-file``)
    #: and JWT bearer tokens (``--jwt-*``); with none of them the frontend is open to
    #: anyone who reaches it. Never in a repr: a config may be logged.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_file: str | None = None
    jwt: JwtConfig | None = None
    #: Of ``PUBLIC_ROUTE_CHOICES``, the routes open to callers without a key
    #: (``--public-route``); ``/health`` and ``/live`` always are.
    public_routes: tuple[str, ...] = ()
    #: HTTPS: the server's certificate chain and its private key, PEM (``--tls-cert``,
    #: ``--tls-key``); None: plain HTTP.
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Tenants with their own label in ``turnout_tenant_*`` and ``/admin/usage``; the
    #: others are counted together under ``_other``.
    tenant_metrics_max: int = 100
    #: Tenants whose prompts hash into the un-tenanted cache space, sharing cached prefixes
    #: with each other and the ``default`` tenant (``--shared-cache-tenants``).
    shared_cache_tenants: frozenset[str] = frozenset()
    #: Seconds a drain lets the requests in flight finish before the listener closes
    #: (``--drain-timeout``).
    drain_timeout: float = 30.0


def server_ssl_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The HTTPS context of ``--tls-cert``/``--tls-key`` (TLS 1.2 at least; HTTP/1.1 by
    ALPN), or None when neither is given; a ``ConfigError`` naming the file when one is
    missing or does not load."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ConfigError("--tls-cert and --tls-key go together")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(cert, key)
    except OSError as exc:
        raise ConfigError(f"--tls-cert {cert} / --tls-key {key}: {exc.strerror or exc}") from None
    except ssl.SSLError as exc:
        raise ConfigError(
            f"--tls-cert {cert} / --tls-key {key}: not a certificate and its key: {exc.reason}"
        ) from None
    return context


def make_authenticator(config: FrontendConfig) -> Authenticator | None:
    """The frontend's authenticator, or None when no credential is configured."""
    if not config.api_keys and config.api_keys_file is None and config.jwt is None:
        return None
    return Authenticator(config.api_keys, config.api_keys_file, config.jwt)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server to this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Frontend:
    """Owns the runtime, the watcher task and the HTTP server."""

    def __init__(
        self,
        config: FrontendConfig,
        runtime: DistributedRuntime | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        """``clock``: admission's time source (tests inject one; default: the event loop)."""
        self.config = config
        if config.reject_status not in REJECT_STATUSES:
            raise ConfigError(
                f"--reject-status must be one of {', '.join(map(str, REJECT_STATUSES))}, "
                f"got {config.reject_status}"
            )
        # Before anything waits for workers: a mode that cannot keep adapter traffic on the
        # adapter's holders fails here, in one line (as Dynamo does).
        validate_router_mode_for_lora(
            config.router_mode,
            lora_enabled=config.enable_lora,
            session_affinity_enabled=config.router_session_affinity_ttl_s is not None,
        )
        if config.response_store_ttl <= 0 or config.response_store_max_bytes <= 0:
            raise ConfigError(
                "--response-store-ttl and --response-store-max-bytes must be positive"
            )
        unknown = set(config.public_routes) - set(PUBLIC_ROUTE_CHOICES)
        if unknown:
            raise ConfigError(
                f"--public-route {', '.join(sorted(unknown))}: only "
                f"{', '.join(PUBLIC_ROUTE_CHOICES)} can be public"
            )
        #: Who may call (None: anyone); the HTTPS context (None: plain HTTP).
        self.auth = make_authenticator(config)
        self._ssl = server_ssl_context(config.tls_cert, config.tls_key)
        self._sighup = False
        #: The Responses API's store (None: ``off``); opened by ``start``.
        self.response_store = make_response_store(config.response_store)
        self.admission = AdmissionController(
            AdmissionLimits(
                max_inflight=config.max_inflight,
                max_inflight_per_model=config.max_inflight_per_model,
                queue_size=config.queue_size,
                queue_timeout=config.queue_timeout,
            ),
            clock=clock,
        )
        self.metrics = FrontendMetrics()
        #: Tenants' usage (``/admin/usage``, ``turnout_tenant_*``) and limits: kept once
        #: callers have credentials (None without: one anonymous caller, nothing to divide).
        self.usage: TenantUsage | None = None
        self.tenants: TenantLimits | None = None
        if self.auth is not None:
            self.usage = TenantUsage(self.metrics.registry, max_tenants=config.tenant_metrics_max)
            self.tenants = TenantLimits(rejections=self.usage)
        if config.prompt_cache_bytes < 0:
            raise ConfigError("--prompt-cache-mib must be >= 0 (0 turns the cache off)")
        self.prompt_cache = PromptCache(config.prompt_cache_bytes)
        self.metrics.registry.register(PromptCacheCollector(self.prompt_cache))
        self.manager = ModelManager()
        #: Who holds and can load which LoRA adapter (None: LoRA serving off).
        self.lora: LoraRegistry | None = None
        if config.enable_lora:
            self.lora = LoraRegistry()
            self.manager.lora = LoraModels(self.lora)
        self.runtime = runtime
        self._owns_runtime = runtime is None
        self._tasks: list[asyncio.Task[None]] = []
        self._server: HttpServer | None = None
        self.watcher: ModelWatcher | None = None
        #: The HTTP routes (set by ``start``).
        self.http: HttpService | None = None
        self.factory: PipelineFactory | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self._ssl is not None else "http"
        return f"{scheme}://{self.config.host}:{self.config.port}"

    async def start(self) -> None:
        cfg = self.config
        store = self.response_store
        if store is not None:  # first: a store that cannot open leaves nothing else open
            await store.open()
            log.info("response store: %s", store.description)
        history = ResponseHistory(
            store,
            ttl=cfg.response_store_ttl,
            max_record_bytes=cfg.response_store_max_bytes,
            max_items=cfg.limits.max_messages,
        )
        if self.runtime is None:
            self.runtime = await open_runtime(cfg.planes)
        factory = self.factory = PipelineFactory(
            router_mode=cfg.router_mode,
            migration_limit=cfg.migration_limit,
            metrics=self.metrics,
            kv_config=cfg.kv,
            kv_share_active=cfg.kv_share_active,
            event_plane=self.runtime.event_plane,
            min_initial_workers=cfg.router_min_initial_workers,
            request_timeout=cfg.request_timeout,
            ttft_timeout=cfg.ttft_timeout,
            stall_timeout=cfg.stall_timeout,
            session_affinity_ttl_s=cfg.router_session_affinity_ttl_s,
            lora=self.lora,
            device_types=self.manager.device_types,
            cpu_gpu_ratio=cfg.router_cpu_gpu_ratio,
            prefill_min_tokens=cfg.prefill_min_tokens,
            decode_fallback=cfg.decode_fallback,
            limits=cfg.limits,
            disagg_metrics=DisaggMetrics(self.metrics.registry),
            max_artifact_bytes=cfg.max_artifact_bytes,
            prompt_cache=self.prompt_cache,
            cache_spaces=CacheSpaces(cfg.shared_cache_tenants),
            artifacts=ArtifactFetcher(
                disk="env"
                if cfg.artifact_cache is None
                else DiskArtifactCache.from_setting(cfg.artifact_cache)
            ),
        )
        self.metrics.watch_kv_routers(factory.kv_routers)
        manager = self.manager
        self.metrics.watch_models(
            lambda: {name: len(manager.model_instances(name)) for name in manager.list_models()}
        )
        runtime = self.runtime
        self.metrics.registry.register(StoreContactCollector(lambda: runtime.store))
        self.metrics.registry.register(SessionAffinityCollector(factory.session_tables))
        self.watcher = ModelWatcher(
            self.runtime, self.manager, factory, namespace=cfg.namespace, lora=self.lora
        )
        self._tasks.append(asyncio.create_task(self.watcher.watch(), name="model-watcher"))
        service = HttpService(
            self.manager,
            self.metrics,
            max_body_bytes=cfg.max_body_bytes,
            admission=self.admission,
            reject_status=cfg.reject_status,
            busy_thresholds=BusyThresholds(
                self.manager.list_models, factory.kv_routers, cfg.router_mode
            ),
            prefill=self._prefill_health,
            limits=cfg.limits,
            history=history,
            auth=self.auth,
            public_routes=cfg.public_routes,
            tenants=self.tenants,
            usage=self.usage,
        )
        self.http = service
        self._mount_dashboard(factory)
        service.add_routes(ScrapeTargetRoutes(runtime.store).routes())  # Prometheus' discovery
        limits = dataclasses.replace(cfg.http, reject_status=cfg.reject_status)
        self._server = HttpServer(service, cfg.host, cfg.port, limits=limits, ssl=self._ssl)
        await self._server.start()
        self._log_access()
        self.metrics.watch_http(self._server)
        self._tasks.append(asyncio.create_task(self._server.serve(), name="http"))
        if store is not None:
            sweep = history.sweep_forever(min(SWEEP_INTERVAL_S, cfg.response_store_ttl))
            self._tasks.append(asyncio.create_task(sweep, name="response-store-sweep"))
        log.info("frontend listening on %s", self.url)

    def _log_access(self) -> None:
        """Say who may call, and install the ``SIGHUP`` reload when there are files to read."""
        cfg = self.config
        auth = self.auth
        if auth is None:
            if not is_loopback(cfg.host):
                log.warning(
                    "frontend bound to %s with no --api-key, --api-keys-file or --jwt-issuer: "
                    "anyone who reaches it may use every model and the control routes",
                    cfg.host,
                )
            return
        log.info("frontend access: %s", auth.describe())
        if cfg.api_keys_file is not None or cfg.jwt is not None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, auth.reload)
            self._sighup = True

    def _mount_dashboard(self, factory: PipelineFactory) -> None:
        """``/dashboard``, and the task that samples its latency history."""
        watcher = self.watcher

        def prefill(name: str) -> list[int] | None:
            watch = watcher.prefill if watcher is not None else None
            return watch.instances(name) if watch is not None else None

        view = FleetView(
            self.manager,
            self.metrics,
            LatencyHistory(self.metrics),
            factory=factory,
            admission=self.admission,
            prefill=prefill,
            router_mode=self.config.router_mode.value,
        )
        dashboard = DashboardRoutes(view)
        assert self.http is not None
        self.http.add_routes(dashboard.routes())
        self._tasks.append(asyncio.create_task(dashboard.run(), name="dashboard-history"))

    def _prefill_health(self, name: str) -> dict[str, object] | None:
        """``/health``'s disaggregation view of a model: its workers' role, its prefill
        instances, whether requests can run (None: an aggregated model, nothing to say)."""
        watch = self.watcher.prefill if self.watcher is not None else None
        prefill = watch.instances(name) if watch is not None else None
        roles = {card.worker_role.value for card in self.manager.entries_for_model(name)}
        if prefill is None and roles <= {"aggregated"}:
            return None
        ready = bool(prefill) or self.config.decode_fallback
        return {
            "roles": sorted(roles),
            "prefill_instances": [f"{i:x}" for i in prefill or []],
            "disaggregated": bool(prefill),
            "ready": ready,
        }

    async def wait(self) -> None:
        """Until the HTTP server or the watcher stops (normally: never). Either stopping is
        a failure of the whole process: raised as ``TurnoutError`` naming the task and why,
        so the command exits non-zero and a supervisor restarts it."""
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            exc = None if task.cancelled() else task.exception()
            reason = f"{type(exc).__name__}: {exc}" if exc else "it returned"
            raise TurnoutError(f"frontend task {task.get_name()!r} stopped: {reason}") from exc

    async def drain(self) -> None:
        """Refuse new work and let the requests in flight finish (see the module docstring);
        ``stop`` then closes the listener. Cancelling it (a second signal) ends the wait."""
        if self.http is None or self._server is None:
            return
        self.http.draining = True
        timeout = self.config.drain_timeout
        log.info(
            "draining: /health answers 503 and new requests are refused; waiting up to %gs "
            "for %d request(s) in flight",
            timeout,
            self._server.num_in_flight,
        )
        if await self._server.wait_idle(timeout):
            log.info("drained: no request in flight")
        else:
            log.warning(
                "drain timeout (%gs) passed with %d request(s) in flight; closing them",
                timeout,
                self._server.num_in_flight,
            )

    async def stop(self) -> None:
        if self._sighup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._sighup = False
        if self._server is not None:
            self._server.stop()
        self.admission.close()
        for task in self._tasks:
            if task.get_name() != "http":
                task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=10)
        self._tasks.clear()
        if self.factory is not None:
            await self.factory.close()
        await self.manager.close()
        if self.response_store is not None:
            await self.response_store.close()
        if self.runtime is not None and self._owns_runtime:
            await self.runtime.shutdown()


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral port that was free a moment ago (for tests and ``--port 0``)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
