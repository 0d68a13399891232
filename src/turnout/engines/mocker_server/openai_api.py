"""The OpenAI routes both engines serve: ``POST /v1/completions``, ``POST /v1/chat/completions``
and ``GET /v1/models``, with each engine's own extra fields.

vLLM (``vllm/entrypoints/openai/completion/protocol.py`` and ``serving.py``, ``chat_completion/``):

* ``prompt`` is a string, a list of ids, or a batch of either (one choice per prompt);
  ``max_tokens`` defaults to 16 on completions; ``stop_token_ids``, ``ignore_eos``,
  ``min_tokens``, ``skip_special_tokens``, ``cache_salt`` are read.
* choices carry ``stop_reason`` (the stop token id or string; null for EOS and length);
  ``return_token_ids: true`` adds ``prompt_token_ids`` and ``token_ids`` to each choice (to
  the first streamed chunk of a choice only for ``prompt_token_ids``; ``token_ids`` holds
  each chunk's new ids). Streamed chunks keep the keys null when not asked, as vLLM's
  ``exclude_unset`` does; chat puts ``prompt_token_ids`` on the response (the first chunk).
* ``stream_options.include_usage`` adds a last chunk with ``choices: []`` and ``usage``;
  ``continuous_usage_stats`` puts ``usage`` on every chunk.
* ``/v1/models`` entries carry ``max_model_len``, ``root``, ``parent``.

SGLang (``python/sglang/srt/entrypoints/openai/serving_completions.py``, ``serving_chat.py``,
``protocol.py``): the same request fields; choices carry ``matched_stop`` (the EOS or stop
token id, or the stop string) instead of ``stop_reason``.

Both: ``usage.prompt_tokens_details.cached_tokens`` says how many prompt tokens the prefix
cache served (vLLM sends it with ``--enable-prompt-tokens-details``, SGLang with
``--enable-cache-report``: always on here, it is what a router benchmark wants to read).
Refused with a 400 naming the field: ``n`` > 1, ``echo``, ``suffix``, ``best_of`` > 1,
``use_beam_search``, ``prompt_logprobs``, and constrained outputs (``response_format`` other
than text, ``guided_*``, ``structured_outputs``): the mocker cannot honour them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from turnout.engines.mocker_server.app import (
    Routes,
    get_bool,
    get_float,
    get_int,
    get_int_list,
    get_stop_strings,
    get_str,
    new_id,
    now_s,
    read_json,
    send_json,
    until_disconnect,
)
from turnout.engines.mocker_server.backend import GenerateParams, Generation, MockerBackend
from turnout.engines.mocker_server.choices import (
    merge_choices,
    run_choice,
)
from turnout.engines.mocker_server.metrics import Api
from turnout.engines.mocker_server.openai_bodies import OpenAIWriter
from turnout.engines.mocker_server.text import TextStream
from turnout.errors import RequestError, TemplateLimitExceeded
from turnout.frontend.http.errors import SERVER_ERROR, HttpError
from turnout.runtime.context import RequestContext
from turnout.runtime.http import Exchange, Scope

#: Most prompts in one completions request.
MAX_PROMPTS = 256
#: Fields the mocker cannot honour: a 400 naming the field rather than a silent ignore.
_UNSUPPORTED = (
    "suffix",
    "prompt_logprobs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


class OpenAIRoutes:
    """The OpenAI routes of one face (``api``) over a ``MockerBackend``."""

    def __init__(self, backend: MockerBackend, api: Api) -> None:
        self.backend = backend
        self.api = api
        self.writer = OpenAIWriter(api, backend.model.tokenizer)
        self._created = now_s()

    def register(self, routes: Routes) -> None:
        routes.add("POST", "/v1/completions", self.completions)
        routes.add("POST", "/v1/chat/completions", self.chat)
        routes.add("GET", "/v1/models", self.models)

    # ------------------------------------------------------------ /v1/models

    async def models(self, scope: Scope, exchange: Exchange) -> None:
        model = self.backend.model
        owner = "vllm" if self.api is Api.VLLM else "sglang"
        card = {
            "id": model.name,
            "object": "model",
            "created": self._created,
            "owned_by": owner,
            "root": model.path,
            "parent": None,
            "max_model_len": model.max_model_len,
        }
        data = [card]
        for lora in sorted(self.backend.engine.config.lora_adapters):
            data.append({**card, "id": lora, "root": lora, "parent": model.name})
        send_json(exchange, {"object": "list", "data": data})

    # ------------------------------------------------------------ shared decoding

    def resolve_model(self, body: dict[str, Any]) -> str | None:
        """The LoRA adapter the request's ``model`` names (None: the base model); 404 for a
        model this server does not serve."""
        name = get_str(body, "model")
        served = self.backend.model.name
        if name is None or name == served:
            return None
        if name in self.backend.engine.config.lora_adapters:
            return name
        raise HttpError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )

    def _params(
        self, body: dict[str, Any], ids: list[int], max_tokens: int | None
    ) -> GenerateParams:
        # Chat says ``logprobs: true`` and ``top_logprobs: k``; completions ``logprobs: k``.
        raw = body.get("logprobs")
        logprobs: int | None
        if isinstance(raw, bool):
            logprobs = get_int(body, "top_logprobs", 0, minimum=0) if raw else None
        else:
            logprobs = get_int(body, "logprobs", None, minimum=0)
        return GenerateParams(
            token_ids=ids,
            max_tokens=max_tokens,
            min_tokens=get_int(body, "min_tokens", 0, minimum=0) or 0,
            ignore_eos=get_bool(body, "ignore_eos"),
            stop_token_ids=get_int_list(body, "stop_token_ids"),
            temperature=get_float(body, "temperature"),
            top_p=get_float(body, "top_p"),
            top_k=get_int(body, "top_k", None),
            seed=get_int(body, "seed", None),
            logprobs=logprobs,
            skip_special_tokens=get_bool(body, "skip_special_tokens", True),
            lora_name=self.resolve_model(body),
            cache_salt=get_str(body, "cache_salt"),
        )

    def _refuse_unsupported(self, body: dict[str, Any]) -> None:
        n = get_int(body, "n", 1, minimum=1)
        if n != 1:
            raise HttpError(400, "n > 1 is not supported by the mocker-server", param="n")
        if get_int(body, "best_of", 1, minimum=1) != 1:
            raise HttpError(
                400, "best_of > 1 is not supported by the mocker-server", param="best_of"
            )
        if get_bool(body, "echo"):
            raise HttpError(400, "echo is not supported by the mocker-server", param="echo")
        if get_bool(body, "use_beam_search"):
            raise HttpError(
                400, "beam search is not supported by the mocker-server", param="use_beam_search"
            )
        for name in _UNSUPPORTED:
            if body.get(name) not in (None, "", [], {}):
                raise HttpError(400, f"{name} is not supported by the mocker-server", param=name)
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise HttpError(
                400,
                "response_format is not supported by the mocker-server (its tokens are random)",
                param="response_format",
            )

    def _stream_options(self, body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
        options = body.get("stream_options")
        if options is None:
            return False, False
        if not isinstance(options, dict):
            raise HttpError(400, "stream_options must be an object", param="stream_options")
        if not stream:
            raise HttpError(
                400,
                "Stream options can only be defined when `stream=True`.",
                param="stream_options",
            )
        return get_bool(options, "include_usage"), get_bool(options, "continuous_usage_stats")

    def _prompts(self, body: dict[str, Any]) -> list[list[int]]:
        prompt = body.get("prompt")
        tokenizer = self.backend.model.tokenizer
        special = get_bool(body, "add_special_tokens", True)
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt:
            prompts = prompt
        else:
            raise HttpError(
                400,
                "prompt must be a non-empty string, list of token ids, or list of either",
                param="prompt",
            )
        if len(prompts) > MAX_PROMPTS:
            raise HttpError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(tokenizer.encode(p, add_special_tokens=special))
            elif isinstance(p, list) and all(_is_id(t) for t in p):
                out.append(p)
            else:
                raise HttpError(
                    400, "each prompt must be a string or a list of token ids", param="prompt"
                )
        return out

    async def _start_all(
        self, params: list[GenerateParams], ctx: RequestContext, prompt_param: str
    ) -> list[Generation]:
        """Start every choice at once; if any is refused, abort the others and raise."""
        results = await asyncio.gather(
            *(self.backend.start(p, ctx, prompt_param=prompt_param) for p in params),
            return_exceptions=True,
        )
        generations = [r for r in results if isinstance(r, Generation)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            for generation in generations:
                await generation.aclose()
            raise failure
        return generations

    # ------------------------------------------------------------ /v1/completions

    async def completions(self, scope: Scope, exchange: Exchange) -> None:
        body = await read_json(scope, exchange)
        self._refuse_unsupported(body)
        stream = get_bool(body, "stream")
        include_usage, continuous = self._stream_options(body, stream)
        return_ids = self.api is Api.VLLM and get_bool(body, "return_token_ids")
        max_tokens = get_int(body, "max_tokens", 16)
        stops = get_stop_strings(body)
        params = [self._params(body, ids, max_tokens) for ids in self._prompts(body)]
        ctx = RequestContext(get_str(body, "request_id"))
        rid = new_id("cmpl")
        head = {
            "id": rid,
            "object": "text_completion",
            "created": now_s(),
            "model": get_str(body, "model") or self.backend.model.name,
        }

        async def run() -> None:
            generations = await self._start_all(params, ctx, "prompt")
            try:
                runs = [
                    run_choice(i, g, self._text(g.params, stops)) for i, g in enumerate(generations)
                ]
                if stream:
                    await self.writer.stream_completion(
                        exchange,
                        head,
                        merge_choices(runs),
                        params,
                        include_usage=include_usage,
                        continuous=continuous,
                        return_ids=return_ids,
                    )
                else:
                    await self.writer.whole_completion(
                        exchange, head, merge_choices(runs), params, return_ids
                    )
            finally:
                for generation in generations:
                    await generation.aclose()

        await until_disconnect(exchange, run())

    def _text(self, params: GenerateParams, stops: list[str]) -> TextStream:
        return TextStream(
            self.backend.model.tokenizer,
            params.token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=stops,
        )

    # ------------------------------------------------------------ /v1/chat/completions

    def chat_prompt(self, body: dict[str, Any]) -> list[int]:
        model = self.backend.model
        template = model.chat_template
        if template is None:
            raise HttpError(400, f"model {model.name} has no chat template; use /v1/completions")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages must be a non-empty list", param="messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise HttpError(400, "tools must be a list", param="tools")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise HttpError(
                400, "chat_template_kwargs must be an object", param="chat_template_kwargs"
            )
        try:
            text = template.render(
                messages,
                add_generation_prompt=get_bool(body, "add_generation_prompt", True),
                tools=tools,
                **{k: v for k, v in kwargs.items() if isinstance(k, str)},
            )
        except RequestError as exc:
            raise HttpError(400, str(exc), param=exc.param or "messages") from None
        except TemplateLimitExceeded as exc:
            raise HttpError(
                500,
                f"the model's chat template failed: {exc}",
                type=SERVER_ERROR,
                code="chat_template_limit",
            ) from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise HttpError(400, f"invalid messages: {exc}", param="messages") from None
        special = get_bool(body, "add_special_tokens", False)
        return model.tokenizer.encode(text, add_special_tokens=special)

    async def chat(self, scope: Scope, exchange: Exchange) -> None:
        body = await read_json(scope, exchange)
        self._refuse_unsupported(body)
        stream = get_bool(body, "stream")
        include_usage, continuous = self._stream_options(body, stream)
        return_ids = self.api is Api.VLLM and get_bool(body, "return_token_ids")
        max_tokens = get_int(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = get_int(body, "max_tokens", None)
        stops = get_stop_strings(body)
        params = self._params(body, self.chat_prompt(body), max_tokens)
        want_logprobs = params.logprobs is not None
        ctx = RequestContext(get_str(body, "request_id"))
        head = {
            "id": new_id("chatcmpl"),
            "object": "chat.completion",
            "created": now_s(),
            "model": get_str(body, "model") or self.backend.model.name,
        }

        async def run() -> None:
            (generation,) = await self._start_all([params], ctx, "messages")
            async with generation:
                deltas = run_choice(0, generation, self._text(params, stops))
                if stream:
                    await self.writer.stream_chat(
                        exchange,
                        head,
                        deltas,
                        params,
                        want_logprobs=want_logprobs,
                        include_usage=include_usage,
                        continuous=continuous,
                        return_ids=return_ids,
                    )
                else:
                    await self.writer.whole_chat(
                        exchange, head, deltas, params, want_logprobs, return_ids
                    )

        await until_disconnect(exchange, run())


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
