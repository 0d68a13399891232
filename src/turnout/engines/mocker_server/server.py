"""``MockerServer``: one simulated engine behind vLLM's or SGLang's face, on turnout's HTTP
server, with its KV events on ZMQ. No discovery store, no planes: a router reaches it as it
reaches a real ``vllm serve`` or SGLang server.

Start-up reads the model (tokenizer, template) off the event loop, builds the mocker engine
(its timing is the calibrated mocker's, ``--speedup-ratio`` included), the face's routes and
metrics, binds the KV publishers (one per data-parallel rank) and then the HTTP port. Stop
is the reverse: the HTTP server stops taking requests, the engine ends every stream (their
requests free their blocks), the publishers close.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field

from turnout.engines.mocker import MockerConfig, MockerEngine
from turnout.engines.mocker_server.app import Routes
from turnout.engines.mocker_server.backend import MockerBackend
from turnout.engines.mocker_server.kv_events import KvEventBridge, rank_endpoint
from turnout.engines.mocker_server.metrics import Api, make_metrics
from turnout.engines.mocker_server.model import ServedModel, load_served_model
from turnout.engines.mocker_server.native_kv import (
    EngineBlockHasher,
    HashType,
    NativeKvPublisher,
)
from turnout.engines.mocker_server.sglang_api import kv_events_config_json, register_sglang
from turnout.engines.mocker_server.vllm_api import register_vllm
from turnout.errors import ConfigError, TurnoutError
from turnout.protocols.native_kv import NativeEncoding
from turnout.runtime.http import HttpLimits, HttpServer

log = logging.getLogger("turnout.mocker_server")


@dataclass(kw_only=True)
class MockerServerConfig:
    """Everything ``turnout mocker-server`` takes."""

    api: Api
    host: str = "127.0.0.1"
    #: 0: a free port (read ``MockerServer.port`` after ``start``).
    port: int = 8000
    #: A GGUF file or HF directory (None: the SmolLM2 GGUF).
    model_path: str | None = None
    served_model_name: str | None = None
    #: Cap on prompt + output (None: the model's context, cut to the KV pool).
    max_model_len: int | None = None
    mocker: MockerConfig = field(default_factory=MockerConfig)
    #: ZMQ PUB address of the KV events (None: no events); rank r binds port + r.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_encoding: NativeEncoding = "array"
    kv_events_topic: str = ""
    kv_events_hash_type: HashType = "int"
    #: SGLang: streamed ``/generate`` events carry only their new text and ids.
    incremental_streaming_output: bool = False
    http: HttpLimits = field(default_factory=HttpLimits)

    def validate(self) -> None:
        if self.api is Api.SGLANG:
            if self.kv_events_encoding != "array":
                raise ConfigError(
                    "--kv-events-encoding map: SGLang writes its events only as arrays"
                )
            if self.kv_events_hash_type != "int":
                raise ConfigError("--kv-events-hash-type bytes: SGLang's block hashes are ints")
        elif self.incremental_streaming_output:
            raise ConfigError("--incremental-streaming-output is SGLang's; this is --api vllm")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1, got {self.max_model_len}")


class MockerServer:
    """See the module docstring. ``start``, then ``wait`` (until the engine fails), ``stop``."""

    def __init__(self, config: MockerServerConfig) -> None:
        config.validate()
        self.config = config
        self.model: ServedModel | None = None
        self.engine: MockerEngine | None = None
        self.backend: MockerBackend | None = None
        self.publishers: list[NativeKvPublisher] = []
        self.bridge: KvEventBridge | None = None
        self._http: HttpServer | None = None
        self._failed = asyncio.Event()

    @property
    def port(self) -> int:
        assert self._http is not None, "start the server first"
        return self._http.port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def start(self) -> None:
        cfg = self.config
        mocker = cfg.mocker
        mocker.validate()
        model = await asyncio.to_thread(
            load_served_model,
            cfg.model_path,
            served_model_name=cfg.served_model_name,
            max_model_len=cfg.max_model_len,
            max_pool_tokens=mocker.max_context_tokens,
        )
        self.model = model
        # The simulated tokens are ids of this model: decodable, and never its EOS by chance.
        mocker = dataclasses.replace(
            mocker,
            vocab_size=model.vocab_size,
            eos_token_ids=list(model.eos_token_ids) or mocker.eos_token_ids,
        )
        engine = MockerEngine(mocker, model_path=model.path, served_model_name=model.name)
        engine.on_failure(lambda reason: self._failed.set())
        self.engine = engine
        metrics = make_metrics(cfg.api, model.name, engine, max_model_len=model.max_model_len)
        backend = MockerBackend(engine, model, metrics)
        self.backend = backend
        routes = Routes()
        if cfg.api is Api.VLLM:
            register_vllm(routes, backend)
        else:
            info = {
                "host": cfg.host,
                "port": cfg.port,
                "kv_events_config": kv_events_config_json(
                    cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, cfg.kv_events_topic
                ),
            }
            register_sglang(
                routes, backend, incremental=cfg.incremental_streaming_output, server_info=info
            )
        try:
            await self._start_kv_events(engine)
            await engine.start()
            self._http = HttpServer(routes, cfg.host, cfg.port, limits=cfg.http)
            await self._http.start()
        except BaseException:
            await self.stop()
            raise
        log.info("mocker-server (%s face) serving %s on %s", cfg.api.value, model.name, self.url)

    async def _start_kv_events(self, engine: MockerEngine) -> None:
        cfg = self.config
        if cfg.kv_events_endpoint is None:
            return
        if not engine.config.enable_prefix_caching:
            raise ConfigError("KV events need prefix caching (leave out --no-prefix-caching)")
        for rank in range(engine.config.dp_size):
            replay = cfg.kv_events_replay_endpoint
            publisher = NativeKvPublisher(
                rank_endpoint(cfg.kv_events_endpoint, rank),
                rank_endpoint(replay, rank) if replay is not None else None,
                api=cfg.api.value,
                encoding=cfg.kv_events_encoding,
                batch_encoding=cfg.kv_events_encoding,
                topic=cfg.kv_events_topic,
            )
            self.publishers.append(publisher)
            try:
                await publisher.start()
            except Exception as exc:
                raise ConfigError(
                    f"cannot bind the KV event sockets of rank {rank} "
                    f"({publisher.endpoint}, {publisher.replay_endpoint}): {exc}"
                ) from exc
        hasher = EngineBlockHasher(hash_type=cfg.kv_events_hash_type)
        self.bridge = KvEventBridge(engine, self.publishers, hasher)

    async def wait(self) -> None:
        """Until the engine fails for good (raised as ``TurnoutError``: exit non-zero)."""
        await self._failed.wait()
        failure = self.engine.failure if self.engine is not None else None
        raise TurnoutError(f"mocker engine failed: {failure}")

    async def stop(self) -> None:
        if self._http is not None:
            self._http.stop()
            self._http = None
        if self.engine is not None:
            await self.engine.stop()
        for publisher in self.publishers:
            await publisher.close()
