"""SGLang's face: its native routes and its OpenAI routes
(``python/sglang/srt/entrypoints/http_server.py``).

``POST /generate`` (``managers/io_struct.py`` ``GenerateReqInput``; output built in
``managers/tokenizer_manager.py`` ``_handle_batch_output``): ``text`` or ``input_ids`` (one
prompt; a batch is refused), ``sampling_params`` {``max_new_tokens`` (default 128),
``min_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``, ``stop_token_ids``,
``ignore_eos``, ``skip_special_tokens``, ``n`` (1 only), ``sampling_seed``}, ``stream``,
``rid``, ``return_logprob``, ``top_logprobs_num``, ``lora_path``. Each answer (the whole
response, or one SSE ``data:`` event per token then ``data: [DONE]``) is ``{"text",
"output_ids", "meta_info"}``; ``meta_info`` holds ``id``, ``finish_reason`` (null until the
end, then ``{"type": "stop", "matched": <token id or string>}`` or ``{"type": "length",
"length": <max_new_tokens>}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``
(known at the end: 0 before), ``weight_version``, and ``e2e_latency`` at the end. Streamed
``text`` and ``output_ids`` are **cumulative** (everything so far), as SGLang sends them by
default; with ``--incremental-streaming-output`` (SGLang's flag) each event carries only
its new text and ids.

``GET /health``, ``GET /health_generate`` (one real 1-token generation), ``GET
/get_model_info`` and ``/model_info``, ``GET /get_server_info`` and ``/server_info``,
``GET /get_load`` (``[{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]`` per rank:
requests running + waiting, waiting, KV tokens in use), ``POST /tokenize`` and
``/v1/tokenize`` (``{"prompt": str | [str], "add_special_tokens"}`` -> ``{"tokens", "count",
"max_model_len"}``), ``POST /detokenize`` and ``/v1/detokenize`` (``{"tokens"}`` ->
``{"text"}``; ``entrypoints/openai/serving_tokenize.py``), ``GET /metrics``
(``metrics.SglangMetrics``).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from turnout.engines.mocker_server.app import (
    Routes,
    SseStream,
    error_event,
    get_bool,
    get_float,
    get_int,
    get_int_list,
    get_stop_strings,
    get_str,
    new_id,
    read_json,
    send_json,
    until_disconnect,
)
from turnout.engines.mocker_server.backend import GenerateParams, MockerBackend
from turnout.engines.mocker_server.choices import Delta, run_choice, token_text
from turnout.engines.mocker_server.metrics import Api
from turnout.engines.mocker_server.openai_api import OpenAIRoutes
from turnout.engines.mocker_server.text import TextStream
from turnout.engines.mocker_server.vllm_api import decode_checked
from turnout.frontend.http.errors import SERVER_ERROR, HttpError
from turnout.runtime.context import RequestContext
from turnout.runtime.http import Exchange, Scope

#: ``/generate``'s default output length (SGLang's ``SamplingParams.max_new_tokens``).
DEFAULT_MAX_NEW_TOKENS = 128
#: Seconds ``/health_generate`` waits for its one token.
HEALTH_GENERATE_TIMEOUT_S = 20.0
VERSION = "0.0.0+turnout.mocker"


def register_sglang(
    routes: Routes, backend: MockerBackend, *, incremental: bool, server_info: dict[str, Any]
) -> None:
    """Every route of the SGLang face; ``server_info`` is what ``/get_server_info`` adds
    to the engine's settings (the launch arguments)."""
    openai = OpenAIRoutes(backend, Api.SGLANG)
    openai.register(routes)
    face = _SglangRoutes(backend, openai, incremental=incremental, server_info=server_info)
    for method in ("POST", "PUT"):
        routes.add(method, "/generate", face.generate)
    routes.add("GET", "/health", face.health)
    routes.add("GET", "/health_generate", face.health_generate)
    routes.add("GET", "/ping", face.health)
    for path in ("/get_model_info", "/model_info"):
        routes.add("GET", path, face.model_info)
    for path in ("/get_server_info", "/server_info"):
        routes.add("GET", path, face.get_server_info)
    routes.add("GET", "/get_load", face.get_load)
    routes.add("GET", "/metrics", face.metrics)
    for path in ("/tokenize", "/v1/tokenize"):
        routes.add("POST", path, face.tokenize)
    for path in ("/detokenize", "/v1/detokenize"):
        routes.add("POST", path, face.detokenize)


class _SglangRoutes:
    def __init__(
        self,
        backend: MockerBackend,
        openai: OpenAIRoutes,
        *,
        incremental: bool,
        server_info: dict[str, Any],
    ) -> None:
        self.backend = backend
        self.openai = openai
        self.incremental = incremental
        self.server_info = server_info

    # ------------------------------------------------------------ /generate

    def _decode(self, body: dict[str, Any]) -> GenerateParams:
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise HttpError(400, "Either text or input_ids should be provided.", param="text")
        tokenizer = self.backend.model.tokenizer
        if isinstance(text, str):
            prompt = tokenizer.encode(text, add_special_tokens=True)
        elif isinstance(ids, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            prompt = ids
        else:
            raise HttpError(
                400,
                "the mocker-server runs one prompt per /generate (text: a string, "
                "input_ids: a list of ids); batches are not supported",
                param="text" if text is not None else "input_ids",
            )
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise HttpError(400, "sampling_params must be an object", param="sampling_params")
        if get_int(sp, "n", 1, minimum=1) != 1:
            raise HttpError(
                400, "n > 1 is not supported by the mocker-server", param="sampling_params.n"
            )
        for name in ("json_schema", "regex", "ebnf", "structural_tag"):
            if sp.get(name) is not None:
                raise HttpError(
                    400,
                    f"{name} is not supported by the mocker-server",
                    param=f"sampling_params.{name}",
                )
        lora = get_str(body, "lora_path")
        if lora is not None and lora not in self.backend.engine.config.lora_adapters:
            raise HttpError(400, f"unknown LoRA adapter {lora!r}", param="lora_path")
        logprobs = None
        if get_bool(body, "return_logprob"):
            logprobs = get_int(body, "top_logprobs_num", 0, minimum=0)
        return GenerateParams(
            token_ids=prompt,
            max_tokens=get_int(sp, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
            min_tokens=get_int(sp, "min_new_tokens", 0, minimum=0) or 0,
            ignore_eos=get_bool(sp, "ignore_eos"),
            stop_token_ids=get_int_list(sp, "stop_token_ids"),
            temperature=get_float(sp, "temperature"),
            top_p=get_float(sp, "top_p"),
            top_k=get_int(sp, "top_k", None),
            seed=get_int(sp, "sampling_seed", None),
            logprobs=logprobs,
            skip_special_tokens=get_bool(sp, "skip_special_tokens", True),
            lora_name=lora,
        )

    async def generate(self, scope: Scope, exchange: Exchange) -> None:
        body = await read_json(scope, exchange)
        params = self._decode(body)
        sp = body.get("sampling_params") or {}
        stops = get_stop_strings(sp)
        stream = get_bool(body, "stream")
        rid = get_str(body, "rid") or new_id("req")[4:]
        text = TextStream(
            self.backend.model.tokenizer,
            params.token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=stops,
        )
        prompt_param = "text" if "text" in body else "input_ids"

        async def run() -> None:
            started = time.monotonic()
            generation = await self.backend.start(
                params, RequestContext(rid), prompt_param=prompt_param
            )
            async with generation:
                answer = _Answer(self, rid, params, started)
                deltas = run_choice(0, generation, text)
                if not stream:
                    async for delta in deltas:
                        answer.add(delta)
                    send_json(exchange, answer.body(cumulative=True))
                    return
                sse = SseStream(exchange)
                try:
                    async for delta in deltas:
                        answer.add(delta)
                        await sse.send(answer.body(cumulative=not self.incremental))
                except HttpError as err:
                    await sse.send_raw(error_event(err))
                await sse.done()

        await until_disconnect(exchange, run())

    # ------------------------------------------------------------ the other routes

    async def health(self, scope: Scope, exchange: Exchange) -> None:
        reason = self.backend.engine.health()
        if reason is not None:
            raise HttpError(
                503, f"engine unhealthy: {reason}", type=SERVER_ERROR, code="service_unavailable"
            )
        exchange.response_bytes(200, [], b"")

    async def health_generate(self, scope: Scope, exchange: Exchange) -> None:
        """One real 1-token generation, as SGLang's probe runs: 200 once it produced its
        token, 503 when the engine refused or did not answer in time."""
        params = GenerateParams(token_ids=[0], max_tokens=1)
        ctx = RequestContext(f"HEALTH_CHECK_{time.time()}")
        try:
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                generation = await self.backend.start(params, ctx)
                async with generation:
                    async for _ in generation:
                        pass
        except (HttpError, TimeoutError) as exc:
            raise HttpError(
                503,
                f"health generation failed: {exc}",
                type=SERVER_ERROR,
                code="service_unavailable",
            ) from None
        exchange.response_bytes(200, [], b"")

    async def model_info(self, scope: Scope, exchange: Exchange) -> None:
        model = self.backend.model
        send_json(
            exchange,
            {
                "model_path": model.path,
                "tokenizer_path": model.path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "served_model_name": model.name,
                "max_model_len": model.max_model_len,
            },
        )

    async def get_server_info(self, scope: Scope, exchange: Exchange) -> None:
        cfg = self.backend.engine.config
        model = self.backend.model
        internal = [
            {
                "dp_rank": rank,
                "num_running_reqs": s.num_running,
                "num_waiting_reqs": s.num_waiting,
                "token_usage": s.pool.usage,
            }
            for rank, s in enumerate(self.backend.engine.get_schedulers())
        ]
        send_json(
            exchange,
            {
                "model_path": model.path,
                "tokenizer_path": model.path,
                "served_model_name": model.name,
                "context_length": model.max_model_len,
                "page_size": cfg.block_size,
                "tp_size": 1,
                "pp_size": 1,
                "dp_size": cfg.dp_size,
                "max_running_requests": cfg.max_num_seqs,
                "max_total_num_tokens": cfg.num_gpu_blocks * cfg.block_size,
                "chunked_prefill_size": cfg.max_num_batched_tokens
                if cfg.enable_chunked_prefill
                else -1,
                "max_prefill_tokens": cfg.max_num_batched_tokens,
                "disable_radix_cache": not cfg.enable_prefix_caching,
                "disaggregation_mode": "null",
                "incremental_streaming_output": self.incremental,
                **self.server_info,
                "internal_states": internal,
                "version": VERSION,
            },
        )

    async def get_load(self, scope: Scope, exchange: Exchange) -> None:
        block_size = self.backend.engine.config.block_size
        send_json(
            exchange,
            [
                {
                    "dp_rank": rank,
                    "num_reqs": s.num_running + s.num_waiting,
                    "num_waiting_reqs": s.num_waiting,
                    "num_tokens": s.pool.num_used * block_size,
                }
                for rank, s in enumerate(self.backend.engine.get_schedulers())
            ],
        )

    async def metrics(self, scope: Scope, exchange: Exchange) -> None:
        exchange.response_bytes(
            200,
            [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
            self.backend.metrics.render(),
        )

    async def tokenize(self, scope: Scope, exchange: Exchange) -> None:
        body = await read_json(scope, exchange)
        self.openai.resolve_model(body)
        model = self.backend.model
        special = get_bool(body, "add_special_tokens", True)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            tokens: Any = model.tokenizer.encode(prompt, add_special_tokens=special)
            count: Any = len(tokens)
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            tokens = [model.tokenizer.encode(p, add_special_tokens=special) for p in prompt]
            count = [len(t) for t in tokens]
        else:
            raise HttpError(400, "prompt must be a string or a list of strings", param="prompt")
        send_json(
            exchange, {"tokens": tokens, "count": count, "max_model_len": model.max_model_len}
        )

    async def detokenize(self, scope: Scope, exchange: Exchange) -> None:
        body = await read_json(scope, exchange)
        self.openai.resolve_model(body)
        skip = get_bool(body, "skip_special_tokens", True)
        tokens = body.get("tokens")
        if isinstance(tokens, list) and tokens and all(isinstance(t, list) for t in tokens):
            texts = [
                decode_checked(
                    self.backend,
                    get_int_list({"tokens": t}, "tokens"),
                    "tokens",
                    skip_special_tokens=skip,
                )
                for t in tokens
            ]
            send_json(exchange, {"text": texts})
            return
        ids = get_int_list(body, "tokens")
        send_json(
            exchange,
            {"text": decode_checked(self.backend, ids, "tokens", skip_special_tokens=skip)},
        )


class _Answer:
    """The ``/generate`` answer of one request as it grows (see the module docstring)."""

    __slots__ = (
        "_face",
        "_final",
        "_new_ids",
        "_new_text",
        "_started",
        "ids",
        "logprobs",
        "params",
        "rid",
        "text",
        "tops",
    )

    def __init__(
        self, face: _SglangRoutes, rid: str, params: GenerateParams, started: float
    ) -> None:
        self._face = face
        self.rid = rid
        self.params = params
        self._started = started
        self.text = ""
        self.ids: list[int] = []
        self.logprobs: list[list[Any]] = []
        self.tops: list[Any] = []
        self._new_text = ""
        self._new_ids: list[int] = []
        self._final: Delta | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.ids.extend(delta.token_ids)
        self._new_text = delta.text
        self._new_ids = delta.token_ids
        if self.params.logprobs is not None:
            tokenizer = self._face.backend.model.tokenizer
            values = delta.logprobs or []
            for i, token_id in enumerate(delta.token_ids):
                self.logprobs.append([values[i] if i < len(values) else None, token_id, None])
                alts = delta.top_logprobs[i] if delta.top_logprobs else None
                self.tops.append(
                    [[lp, t, token_text(tokenizer, t)] for t, lp in alts] if alts else None
                )
        if delta.finish_reason is not None:
            self._final = delta

    def body(self, *, cumulative: bool) -> dict[str, Any]:
        final = self._final
        finish: dict[str, Any] | None = None
        if final is not None:
            if final.finish_reason == "length":
                finish = {"type": "length", "length": self.params.max_tokens}
            else:
                finish = {"type": "stop", "matched": final.matched}
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": finish,
            "prompt_tokens": len(self.params.token_ids),
            "weight_version": "default",
            "completion_tokens": len(self.ids),
            "cached_tokens": final.cached_tokens if final is not None else 0,
        }
        if self.params.logprobs is not None:
            n = len(self._new_ids)
            start = 0 if cumulative else len(self.logprobs) - n
            meta["output_token_logprobs"] = self.logprobs[start:]
            if self.params.logprobs:
                meta["output_top_logprobs"] = self.tops[start:]
        if final is not None:
            meta["e2e_latency"] = time.monotonic() - self._started
        if cumulative:
            return {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}
        return {"text": self._new_text, "output_ids": self._new_ids, "meta_info": meta}


def kv_events_config_json(endpoint: str | None, replay: str | None, topic: str) -> str | None:
    """SGLang's ``--kv-events-config`` for these settings (what ``/get_server_info``
    shows), or None when events are off."""
    if endpoint is None:
        return None
    config = {"publisher": "zmq", "endpoint": endpoint, "topic": topic}
    if replay is not None:
        config["replay_endpoint"] = replay
    return json.dumps(config)
