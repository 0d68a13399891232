"""``turnout frontend``: the HTTP frontend alone; workers register themselves.

The frontend registers itself too (``RegisteredFrontend``): a record under its own lease
says who it is, where it listens, which planes it runs and which instances it holds back
(``runtime.frontend_record``), for ``turnout status`` and for workers checking their planes.
"""

from __future__ import annotations

import argparse
import logging
import socket
from typing import Any

from turnout.errors import ConfigError
from turnout.frontend.http.app import DEFAULT_MAX_BODY_BYTES
from turnout.frontend.http.errors import REJECT_STATUSES
from turnout.frontend.responses.history import DEFAULT_MAX_RECORD_BYTES, DEFAULT_TTL_S
from turnout.frontend.responses.store import DEFAULT_RESPONSE_STORE, default_sqlite_path
from turnout.frontend.service import Frontend, FrontendConfig
from turnout.llm.limits import RequestLimits
from turnout.llm.prompt_cache import DEFAULT_MAX_BYTES
from turnout.protocols.card_bounds import DEFAULT_MAX_ARTIFACT_BYTES
from turnout.router.kv.config import KvRouterConfig, RouterCost
from turnout.router.mode import RouterMode
from turnout.runtime.addresses import format_host_port, is_wildcard
from turnout.runtime.frontend_record import FrontendRegistration
from turnout.runtime.http import HttpLimits

from .access_flags import add_access_flags, jwt_config, tenant_config
from .flags import add_flag, add_runtime_flags, planes_config
from .lifecycle import run_command, run_until_signal

log = logging.getLogger("turnout.cli")


def add_frontend_flags(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--host", default="127.0.0.1", help="HTTP bind address")
    add_flag(p, "--port", default=8000, type=int, help="HTTP port")
    add_flag(p, "--router-mode", default="round-robin",
             help="round-robin | random | power-of-two | least-loaded | "
                  "device-aware-weighted | direct | kv")  # fmt: skip
    add_flag(p, "--router-cpu-gpu-ratio", default=8, type=int,
             help="device-aware-weighted: how many CPU instances one GPU instance is worth "
                  "(Dynamo's non_cpu_to_cpu_ratio); CPU instances take a request while the CPU "
                  "in-flight total < GPU in-flight total x CPUs / (ratio x GPUs)")  # fmt: skip
    add_flag(p, "--migration-limit", default=3, type=int,
             help="times a request may move to another worker when its worker dies")  # fmt: skip
    add_flag(p, "--request-timeout", default=0.0, type=float,
             help="seconds a request may take in all, migrations included; past it 504 "
                  "(0: none; nvext.request_timeout may shorten it)")  # fmt: skip
    add_flag(p, "--ttft-timeout", default=0.0, type=float,
             help="seconds a worker may take to its first token before the request "
                  "migrates (0: none)")  # fmt: skip
    add_flag(p, "--stall-timeout", default=0.0, type=float,
             help="seconds a stream may go without a token before it migrates "
                  "(0: none)")  # fmt: skip
    add_flag(p, "--router-min-initial-workers", default=0, type=int,
             help="a model answers 503 until this many of its workers are up")  # fmt: skip
    add_flag(p, "--router-session-affinity-ttl-secs", type=float,
             help="bind a session (x-session-id) to the instance of its first request, "
                  "for as long as it has requests in flight and N idle seconds after "
                  "(default: off)")  # fmt: skip
    add_flag(p, "--enable-lora", action="store_true",
             help="serve LoRA adapters by name, routed to the instances that hold them "
                  "(router modes kv, random, round-robin)")  # fmt: skip
    add_flag(p, "--prefill-min-tokens", default=512, type=int,
             help="disaggregated serving: prompts with fewer tokens not cached on their "
                  "decode worker skip the prefill workers")  # fmt: skip
    add_flag(p, "--decode-fallback", default=True, action=argparse.BooleanOptionalAction,
             help="with no prefill worker, decode workers serve whole requests; "
                  "--no-decode-fallback makes requests wait for one (then 503)")  # fmt: skip
    add_flag(p, "--namespace", help="serve only models of this namespace (default: all)")
    add_flag(p, "--max-body-bytes", default=DEFAULT_MAX_BODY_BYTES, type=int,
             help="largest accepted request body (413 above)")  # fmt: skip
    add_flag(p, "--max-inflight", default=1024, type=int,
             help="requests in flight in the whole frontend; more wait in the queue "
                  "(0: unlimited)")  # fmt: skip
    add_flag(p, "--max-inflight-per-model", default=0, type=int,
             help="requests in flight per model; more wait in the queue "
                  "(0: unlimited)")  # fmt: skip
    add_flag(p, "--queue-size", default=1024, type=int,
             help="requests that may wait for a slot, by nvext.priority (higher first) "
                  "then arrival; past it they are rejected (0: no queue)")  # fmt: skip
    add_flag(p, "--queue-timeout", default=30.0, type=float,
             help="seconds a request may wait for a slot before it is rejected")  # fmt: skip
    add_flag(p, "--reject-status", default=503, type=int, choices=REJECT_STATUSES,
             help="HTTP status of admission rejections, with Retry-After "
                  "(429, 503, or 529 as Dynamo)")  # fmt: skip
    g = p.add_argument_group("client connections")
    add_flag(g, "--http-header-timeout", default=10.0, type=float,
             help="seconds from a connection's opening (or its next request's first byte) "
                  "to the end of the request's headers; then 408 and closed")  # fmt: skip
    add_flag(g, "--http-body-timeout", default=60.0, type=float,
             help="seconds from the end of a request's headers to the end of its body; "
                  "then 408 and closed")  # fmt: skip
    add_flag(g, "--http-keepalive-timeout", default=30.0, type=float,
             help="seconds a connection may sit idle between requests")  # fmt: skip
    add_flag(g, "--client-stall-timeout", default=60.0, type=float,
             help="seconds a response may wait for a client that reads nothing; then the "
                  "connection is closed and its request cancelled on the worker")  # fmt: skip
    add_flag(g, "--max-connections", default=16384, type=int,
             help="open client connections; past it, a new one evicts the longest-idle "
                  "connection with no request in flight")  # fmt: skip
    add_request_limit_flags(p)
    add_flag(p, "--artifact-cache",
             help="directory caching the tokenizers fetched from workers, by checksum "
                  "(off: none; default ~/.cache/turnout/artifacts)")  # fmt: skip
    add_flag(p, "--prompt-cache-mib", default=DEFAULT_MAX_BYTES / 2**20, type=float,
             help="memory for the token ids of chat prompts' pieces (the turns of a "
                  "conversation), shared by all models, so each request encodes only what "
                  "is new; the ids are those of a whole encode (0: off, every prompt "
                  "encoded whole)")  # fmt: skip
    add_flag(p, "--max-artifact-bytes", default=DEFAULT_MAX_ARTIFACT_BYTES, type=int,
             help="largest artifact (tokenizer) a model card may name; a card announcing "
                  "more is refused, a worker sending more is cut off")  # fmt: skip
    g = p.add_argument_group("response store (/v1/responses store, previous_response_id, "
                             "/v1/conversations)")  # fmt: skip
    add_flag(g, "--response-store", default=DEFAULT_RESPONSE_STORE,
             help="where stored responses and conversations live: sqlite:PATH (sqlite: alone: "
                  f"{default_sqlite_path()}), postgres://... or redis://... (shared by "
                  "several frontends), memory: (this process), or off")  # fmt: skip
    add_flag(g, "--response-store-ttl", default=DEFAULT_TTL_S, type=float,
             help="seconds a stored response (or conversation) is kept after its chain's "
                  "last turn (its last change)")  # fmt: skip
    add_flag(g, "--response-store-max-bytes", default=DEFAULT_MAX_RECORD_BYTES, type=int,
             help="largest record stored (one response's input items and body); a larger "
                  "response is answered with store: false")  # fmt: skip
    add_access_flags(p)


def add_request_limit_flags(p: argparse.ArgumentParser) -> None:
    """What one request may ask for (``llm.limits``): past a bound, a 400 naming the field."""
    d = RequestLimits()
    g = p.add_argument_group("request limits (past one: 400 naming the field)")
    add_flag(g, "--max-stop-strings", default=d.max_stop_strings, type=int,
             help="stop strings per request (stop, stop_sequences)")  # fmt: skip
    add_flag(g, "--max-stop-string-chars", default=d.max_stop_string_chars, type=int,
             help="characters of one stop string")  # fmt: skip
    add_flag(g, "--max-stop-token-ids", default=d.max_stop_token_ids, type=int,
             help="stop_token_ids per request")  # fmt: skip
    add_flag(g, "--max-messages", default=d.max_messages, type=int,
             help="messages (or input items) per request")  # fmt: skip
    add_flag(g, "--max-tools", default=d.max_tools, type=int,
             help="tools per request")  # fmt: skip
    add_flag(g, "--max-tools-chars", default=d.max_tools_chars, type=int,
             help="characters of a request's tools, as JSON")  # fmt: skip
    add_flag(g, "--max-choices", default=d.max_choices, type=int,
             help="choices per request (n)")  # fmt: skip
    add_flag(g, "--max-response-items", default=d.max_response_items, type=int,
             help="n x max_tokens x (1 + top_logprobs): the tokens and alternatives a "
                  "response may hold; a request without max_tokens is capped to fit")  # fmt: skip


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_stop_token_ids=args.max_stop_token_ids,
        max_messages=args.max_messages,
        max_tools=args.max_tools,
        max_tools_chars=args.max_tools_chars,
        max_choices=args.max_choices,
        max_response_items=args.max_response_items,
    )


def add_kv_router_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV-aware routing (--router-mode kv)")
    add_flag(g, "--router-cost", default=RouterCost.TTFT.value,
             choices=[c.value for c in RouterCost],
             help="what the KV router minimises: ttft (predicted seconds to first token, "
                  "from workers' reported step times) or blocks (Dynamo's cost)")  # fmt: skip
    add_flag(g, "--router-itl-weight", default=0.0, type=float,
             help="ttft cost: weight of the delay a request's prefill inflicts on the "
                  "requests decoding on the worker (0: ignore it)")  # fmt: skip
    add_flag(g, "--kv-overlap-score-weight", default=1.0, type=float,
             help="blocks cost: weight of the prefill term (higher: favour hits)")  # fmt: skip
    add_flag(g, "--router-session-weight", default=1.0, type=float,
             help="bonus of the worker that served a session's last turn (x-session-id): "
                  "that many of its smallest steps (ttft) or blocks (blocks); 0: off")  # fmt: skip
    add_flag(g, "--router-temperature", default=0.0, type=float,
             help="0: cheapest worker (ties at random); > 0: softmax sampling")  # fmt: skip
    add_flag(g, "--no-kv-events", action="store_true",
             help="approximate mode: predict caches from routing, no KV events")  # fmt: skip
    add_flag(g, "--kv-approx-ttl", default=120.0, type=float,
             help="approximate mode: seconds a routed prefix is assumed cached")  # fmt: skip
    add_flag(g, "--busy-kv-usage-threshold", type=float,
             help="leave out workers whose reported KV usage is above this (0-1)")  # fmt: skip
    add_flag(g, "--busy-num-waiting-threshold", type=int,
             help="leave out workers with more waiting requests than this")  # fmt: skip
    add_flag(g, "--no-router-replica-sync", action="store_true",
             help="do not share in-flight request state with other router replicas")  # fmt: skip


def kv_router_config(args: argparse.Namespace) -> KvRouterConfig:
    return KvRouterConfig(
        router_cost=RouterCost(args.router_cost),
        overlap_score_weight=args.kv_overlap_score_weight,
        session_weight=args.router_session_weight,
        itl_weight=args.router_itl_weight,
        router_temperature=args.router_temperature,
        use_kv_events=not args.no_kv_events,
        approx_ttl_s=args.kv_approx_ttl,
        busy_kv_usage_threshold=args.busy_kv_usage_threshold,
        busy_num_waiting_threshold=args.busy_num_waiting_threshold,
    )


def http_limits(args: argparse.Namespace) -> HttpLimits:
    """The client-connection bounds of the flags, each checked to be positive."""
    for flag in ("http_header_timeout", "http_body_timeout", "http_keepalive_timeout",
                 "client_stall_timeout", "max_connections"):  # fmt: skip
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive")
    return HttpLimits(
        header_timeout=args.http_header_timeout,
        body_timeout=args.http_body_timeout,
        keepalive_timeout=args.http_keepalive_timeout,
        write_timeout=args.client_stall_timeout,
        max_connections=args.max_connections,
    )


def frontend_config(args: argparse.Namespace) -> FrontendConfig:
    tenants = tenant_config(args)
    return FrontendConfig(
        host=args.host,
        port=args.port,
        planes=planes_config(args),
        namespace=args.namespace,
        router_mode=RouterMode.parse(args.router_mode),
        migration_limit=args.migration_limit,
        max_body_bytes=args.max_body_bytes,
        limits=request_limits(args),
        http=http_limits(args),
        kv=kv_router_config(args),
        kv_share_active=not args.no_router_replica_sync,
        router_min_initial_workers=args.router_min_initial_workers,
        artifact_cache=args.artifact_cache,
        max_artifact_bytes=args.max_artifact_bytes,
        prompt_cache_bytes=int(args.prompt_cache_mib * 2**20),
        max_inflight=args.max_inflight,
        max_inflight_per_model=args.max_inflight_per_model,
        queue_size=args.queue_size,
        queue_timeout=args.queue_timeout,
        reject_status=args.reject_status,
        request_timeout=args.request_timeout,
        ttft_timeout=args.ttft_timeout,
        stall_timeout=args.stall_timeout,
        router_session_affinity_ttl_s=args.router_session_affinity_ttl_secs,
        enable_lora=args.enable_lora,
        router_cpu_gpu_ratio=args.router_cpu_gpu_ratio,
        prefill_min_tokens=args.prefill_min_tokens,
        decode_fallback=args.decode_fallback,
        response_store=args.response_store,
        response_store_ttl=args.response_store_ttl,
        response_store_max_bytes=args.response_store_max_bytes,
        api_keys=tuple(args.api_key),
        api_keys_file=args.api_keys_file,
        jwt=jwt_config(args),
        public_routes=tuple(dict.fromkeys(args.public_route)),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        shared_cache_tenants=tenants.shared_cache_tenants,
        tenant_metrics_max=tenants.tenant_metrics_max,
        drain_timeout=args.drain_timeout,
    )


class RegisteredFrontend(Frontend):
    """A ``Frontend`` that publishes its record (see the module docstring) once it serves,
    and withdraws it first when it stops."""

    registration: FrontendRegistration | None = None

    def _reachable_url(self) -> str:
        """The URL others may dial: this machine's name instead of a wildcard bind, which
        ``turnout status`` would otherwise print as ``http://0.0.0.0:8000``."""
        if not is_wildcard(self.config.host):
            return self.url
        scheme = self.url.split("://", 1)[0]
        return f"{scheme}://{format_host_port(socket.gethostname(), self.config.port)}"

    async def start(self) -> None:
        await super().start()
        assert self.runtime is not None and self.watcher is not None
        registration = FrontendRegistration(
            self.runtime,
            http_address=self._reachable_url(),
            router_mode=self.config.router_mode.value,
            namespace=self.config.namespace,
            held_back=self.watcher.held_back,
            changed=self.watcher.held_back_changed,
        )
        await registration.start()
        self.registration = registration

    async def stop(self) -> None:
        try:
            if self.registration is not None:
                await self.registration.stop()
        finally:
            await super().stop()


def register(sub: Any) -> None:
    p = sub.add_parser("frontend", help="run the OpenAI-compatible HTTP frontend")
    add_frontend_flags(p)
    add_kv_router_flags(p)
    add_runtime_flags(p)
    add_flag(p, "--drain-timeout", default=30.0, type=float,
             help="on SIGTERM, /health answers 503 and new requests are refused at once; "
                  "seconds the requests in flight may finish before the listener closes "
                  "(a second signal stops at once)")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    async def main() -> None:
        frontend = RegisteredFrontend(frontend_config(args))
        await run_until_signal(frontend.start, frontend.stop, frontend.wait, frontend.drain)

    return run_command(args, main)
