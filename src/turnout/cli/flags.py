"""Flags with environment defaults: every ``--some-flag`` reads ``TURNOUT_SOME_FLAG``."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from turnout.runtime.addresses import DEFAULT_HOST
from turnout.runtime.log_context import LOG_FORMATS, log_handler
from turnout.runtime.plane_tls import PlaneTls
from turnout.runtime.planes import PlanesConfig
from turnout.runtime.redact import disable_prompt_logging, enable_prompt_logging, redact_url
from turnout.runtime.request_plane.framing import DEFAULT_MAX_FRAME_BYTES, check_max_frame_bytes


def env_name(flag: str) -> str:
    return "TURNOUT_" + flag.lstrip("-").upper().replace("-", "_")


def add_flag(
    parser: argparse.ArgumentParser | Any,
    flag: str,
    *,
    default: Any = None,
    secret: bool = False,
    **kwargs: Any,
) -> None:
    """``parser.add_argument`` whose default comes from the flag's environment variable.
    ``secret``: a password or token, whose value ``--help`` never shows."""
    env = env_name(flag)
    value = os.environ.get(env)
    if value is not None:
        if kwargs.get("action") == "store_true":
            default = value.strip().lower() in ("1", "true", "yes", "on")
        elif kwargs.get("action") is argparse.BooleanOptionalAction:
            word = value.strip().lower()
            if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise SystemExit(f"turnout: bad value {value!r} in ${env}: say true or false")
            default = word in ("1", "true", "yes", "on")
        else:
            conv = kwargs.get("type", str)
            try:
                default = conv(value)
            except (TypeError, ValueError) as exc:
                raise SystemExit(f"turnout: bad value {value!r} in ${env}: {exc}") from None
    help_text = kwargs.pop("help", "")
    shown = default is not None and default is not False and not secret
    if shown and isinstance(default, str) and "://" in default:
        default_text = ",".join(redact_url(url) for url in default.split(","))
    else:
        default_text = str(default)
    kwargs["help"] = f"{help_text} [env {env}]" + (f" (default: {default_text})" if shown else "")
    parser.add_argument(flag, default=default, **kwargs)


def add_runtime_flags(
    parser: argparse.ArgumentParser, *, planes: bool = True, tracing: bool = True
) -> None:
    """Discovery, planes, addresses, leases, logs, traces. ``planes=False`` (``serve``, which
    always runs the file store, tcp and zmq on this machine) keeps only the settings that still
    mean something there; ``tracing=False`` (``status``, which serves no request) leaves out
    ``--otlp-endpoint``."""
    if planes:
        add_flag(parser, "--store", default="file", choices=["memory", "file", "etcd"],
                 help="discovery store")  # fmt: skip
    add_flag(parser, "--store-path", help="file store location (default: a per-user temp path)")
    if planes:
        g = parser.add_argument_group("etcd (--store etcd)")
        add_flag(g, "--store-endpoints", default="http://127.0.0.1:2379",
                 help="comma-separated etcd endpoints (https:// for TLS)")  # fmt: skip
        add_flag(g, "--store-ca-cert", help="CA certificate that signed etcd's (PEM)")
        add_flag(g, "--store-cert", help="client certificate for etcd (PEM)")
        add_flag(g, "--store-key", help="key of --store-cert (PEM)")
        add_flag(g, "--store-user", help="etcd user")
        add_flag(g, "--store-password", help="etcd password", secret=True)
        add_flag(parser, "--request-plane", default="tcp", choices=["tcp", "nats", "local"],
                 help="request plane between frontend and workers")  # fmt: skip
        add_flag(parser, "--event-plane", choices=["local", "zmq", "nats"],
                 help="KV events and load reports (default: local on the memory store, "
                      "else zmq)")  # fmt: skip
        g = parser.add_argument_group("NATS (--request-plane nats, --event-plane nats)")
        add_flag(g, "--nats-url", default="nats://127.0.0.1:4222",
                 help="comma-separated NATS servers (user:password@ allowed)")  # fmt: skip
        add_flag(g, "--nats-user", help="NATS user")
        add_flag(g, "--nats-password", help="NATS password", secret=True)
        add_flag(g, "--nats-token", help="NATS token", secret=True)
        add_flag(g, "--nats-ca-cert", help="CA certificate that signed the NATS server's (PEM)")
        add_flag(g, "--nats-cert", help="client certificate for NATS (PEM)")
        add_flag(g, "--nats-key", help="key of --nats-cert (PEM)")
        add_flag(parser, "--bind-host", default=DEFAULT_HOST,
                 help="interface this process's request-plane and event servers bind "
                      "(0.0.0.0: all)")  # fmt: skip
        add_flag(parser, "--advertise-host",
                 help="address other hosts dial for those servers (default: the bound one; "
                      "for 0.0.0.0, the interface that routes to the store)")  # fmt: skip
    g = parser.add_argument_group(
        "plane security (mutual TLS on the tcp request plane, CurveZMQ on the zmq event plane)"
    )
    add_flag(g, "--plane-ca", help="the deployment CA's certificate, which signed every "
             "process's --plane-cert (PEM)")  # fmt: skip
    add_flag(g, "--plane-cert", help="this process's certificate on the planes (PEM)")
    add_flag(g, "--plane-key", help="key of --plane-cert (PEM)")
    add_flag(parser, "--lease-ttl", default=10.0, type=float,
             help="seconds a dead process's registrations outlive it")  # fmt: skip
    add_flag(parser, "--max-frame-bytes", default=DEFAULT_MAX_FRAME_BYTES, type=int,
             help="largest request-plane frame (a request, a reply item) sent or read; a "
                  "peer announcing more is disconnected. Give every process of a deployment "
                  "the same value")  # fmt: skip
    add_flag(parser, "--log-level", default="info",
             choices=["debug", "info", "warning", "error"], help="log level")  # fmt: skip
    add_flag(parser, "--log-format", default="text", choices=list(LOG_FORMATS),
             help="log lines as text, or as one JSON object per line (with the request id, "
                  "model, instance and tenant of the request a line is about)")  # fmt: skip
    if tracing:
        add_flag(parser, "--otlp-endpoint",
                 help="send OpenTelemetry traces over OTLP/HTTP (protobuf) to URL/v1/traces "
                      "(default: tracing off)")  # fmt: skip
    add_flag(parser, "--log-prompts", action="store_true",
             help="log prompts and request bodies at debug level, for debugging only: they "
                  "are user data (one warning line at start says it is on)")  # fmt: skip


def _split(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def planes_config(args: argparse.Namespace) -> PlanesConfig:
    """The planes described by ``add_runtime_flags``'s flags (absent ones: their defaults)."""

    def get(name: str) -> Any:
        """The flag's value; None when this command has no such flag."""
        return getattr(args, name, None)

    store = get("store") or "file"
    store_options: dict[str, Any] = {}
    if store == "etcd":
        store_options["endpoints"] = _split(get("store_endpoints"))
        for name in ("ca_cert", "cert", "key", "user", "password"):
            if get(f"store_{name}") is not None:
                store_options[name] = get(f"store_{name}")
    config = PlanesConfig(
        store=store,
        store_path=get("store_path"),
        store_options=store_options,
        request_plane=get("request_plane") or "tcp",
        event_plane=get("event_plane"),
        bind_host=get("bind_host") or DEFAULT_HOST,
        advertise_host=get("advertise_host"),
        lease_ttl=args.lease_ttl,
        max_frame_bytes=(
            DEFAULT_MAX_FRAME_BYTES
            if get("max_frame_bytes") is None
            else check_max_frame_bytes(get("max_frame_bytes"))
        ),
        plane_tls=PlaneTls.from_flags(get("plane_ca"), get("plane_cert"), get("plane_key")),
    )
    if config.uses_nats():
        from turnout.runtime.nats import NatsOptions

        nats_options = {
            name: get(f"nats_{name}")
            for name in ("user", "password", "token", "ca_cert", "cert", "key")
            if get(f"nats_{name}") is not None
        }
        config.nats = NatsOptions(servers=_split(get("nats_url")), **nats_options)
    return config


def setup_logging(level: str, *, log_format: str = "text", log_prompts: bool = False) -> None:
    """Log lines to stderr at ``level`` in ``log_format`` (``runtime.log_context``); prompts
    and bodies only with ``log_prompts`` (``turnout.runtime.redact``)."""
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[log_handler(log_format)])
    if log_prompts:
        enable_prompt_logging()
    else:
        disable_prompt_logging()
