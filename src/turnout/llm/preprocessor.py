"""The preprocessor operator: OpenAI request -> ``PreprocessedRequest`` (token ids + options).

Order of work for a request: validate the cheap fields first (no tokenization is wasted on a
request that is wrong anyway), bounds included (``limits.RequestLimits``: stop strings,
messages, tools, choices, the response's size); then refuse a prompt that cannot fit however
it tokenizes (its characters over the most characters one token stands for, the tokenizer's
``max_token_chars``, already reach the context length: a 15 MB prompt is refused in
milliseconds, before the template); then render the chat template and tokenize, then check
the prompt against the context length and derive ``max_tokens``.

Rendering and tokenizing are CPU work that holds the event loop. Short prompts (the usual
case) are done inline — a thread hop costs more than they do; prompts above
``OFFLOAD_THRESHOLD_CHARS`` go to a worker thread (``tokenizers`` releases the GIL while it
encodes, so other requests keep streaming). Each message counts ``MESSAGE_COST_CHARS``
towards that size besides its text: rendering thousands of short messages is slow too.

Every rule that rejects a request raises ``RequestError`` (HTTP 400) with an OpenAI-style
message and the offending ``param``; a prompt that does not fit raises
``ContextLengthExceeded``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from turnout.errors import ContextLengthExceeded, RequestError
from turnout.protocols.llm import (
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from turnout.protocols.model import ModelDeploymentCard
from turnout.protocols.openai import ChatCompletionRequest, ChatMessage, CompletionRequest

from .cache_salt import request_cache_salt
from .chat_template import ChatTemplate
from .limits import RequestLimits
from .openai_fields import check_openai_fields
from .prompt_cache import PromptCache, PromptEncoder, UncachedEncoder
from .reasoning_switch import reasoning_switch
from .structured import source_chars, structured_output
from .tokenizer import Tokenizer

#: Prompt text longer than this (characters) is rendered and tokenized off the event loop.
OFFLOAD_THRESHOLD_CHARS = 8 * 1024
#: What one message weighs in that size besides its text (the template's work per message,
#: ~20 µs, is about that of tokenizing this many characters).
MESSAGE_COST_CHARS = 64

_T = TypeVar("_T")
_json_encode = msgspec.json.Encoder().encode
_Request = ChatCompletionRequest | CompletionRequest
#: Variables the server sets for the template; ``chat_template_kwargs`` may not override them.
_RESERVED_TEMPLATE_VARS = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)


async def _maybe_offload(size: int, fn: Callable[..., _T], *args: Any) -> _T:
    if size > OFFLOAD_THRESHOLD_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_calls is not None:
        d["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.refusal is not None:
        d["refusal"] = m.refusal
    if m.reasoning_content is not None:
        d["reasoning_content"] = m.reasoning_content
    return d


def _prompt_chars(messages: list[ChatMessage]) -> int:
    """Characters of the messages' text and tool calls (names and arguments): what any chat
    template writes at least."""
    size = 0
    for m in messages:
        c = m.content
        if isinstance(c, str):
            size += len(c)
        elif isinstance(c, list):
            for part in c:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    size += len(text)
        for call in m.tool_calls or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                for key in ("name", "arguments"):
                    value = fn.get(key)
                    if isinstance(value, str):
                        size += len(value)
    return size


class Preprocessor:
    """Turns OpenAI requests for one model into token-level requests. Stateless per request."""

    __slots__ = ("_mdc_sum", "_prompt_encoder", "card", "limits", "template", "tokenizer")

    def __init__(
        self,
        card: ModelDeploymentCard,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        limits: RequestLimits | None = None,
        prompt_cache: PromptCache | None = None,
    ) -> None:
        """``prompt_cache``: where rendered chat prompts' pieces are looked up before they
        are encoded (``llm.prompt_cache``; None: every prompt encoded whole)."""
        self.card = card
        self.tokenizer = tokenizer
        self.template = template
        #: What one request may ask for (the frontend's ``--max-*`` flags).
        self.limits = limits if limits is not None else RequestLimits()
        self._mdc_sum = card.checksum()
        self._prompt_encoder: PromptEncoder = (
            UncachedEncoder(tokenizer) if prompt_cache is None else prompt_cache.encoder(tokenizer)
        )

    # ---------------------------------------------------------------- chat

    async def preprocess_chat(
        self, req: ChatCompletionRequest, tenant: str | None = None
    ) -> PreprocessedRequest:
        """``tenant``: the cache space of the request's tenant (``llm.cache_salt``; None:
        the un-tenanted space)."""
        if not req.messages:
            raise RequestError("'messages' must contain at least one message", param="messages")
        self.limits.check_messages(len(req.messages))
        max_tokens: int | None
        if req.max_completion_tokens is not None:
            max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = req.max_tokens, "max_tokens"
        cache_salt = self._validate(req, max_tokens, max_param, tenant)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise RequestError("'top_logprobs' must be between 0 and 20", param="top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        self._check_response(req, max_tokens, max_param, req.top_logprobs or 0, "messages")
        if req.logprobs or req.top_logprobs is not None:
            param = "top_logprobs" if req.top_logprobs else "logprobs"
            self._require_logprobs(req.top_logprobs or 0, param)
        tools_chars = 0
        if req.tools:
            tools_chars = len(_json_encode(req.tools))
            self.limits.check_tools(len(req.tools), tools_chars)
        prompt_chars = _prompt_chars(req.messages)
        self._check_fits(prompt_chars + tools_chars, max_tokens, max_param, "messages")
        self._check_chat_features(req)
        check_openai_fields(req)
        structured = await _maybe_offload(source_chars(req), structured_output, self.card, req)
        template = self.template
        if template is None:
            raise RequestError(
                f"model '{req.model}' has no chat template; use /v1/completions instead",
                param="messages",
            )
        extra = dict(req.chat_template_kwargs or {})
        clash = _RESERVED_TEMPLATE_VARS.intersection(extra)
        if clash:
            raise RequestError(
                f"chat_template_kwargs may not set {sorted(clash)}", param="chat_template_kwargs"
            )
        if req.reasoning_effort is not None:
            switch = reasoning_switch(self.card, req.reasoning_effort, "reasoning_effort")
            for key, value in switch.items():
                if extra.setdefault(key, value) != value:
                    raise RequestError(
                        f"'reasoning_effort' sets the template's '{key}' to {value!r}, which "
                        f"'chat_template_kwargs' sets to {extra[key]!r}; give one",
                        param="reasoning_effort",
                    )
        messages = [_message_dict(m) for m in req.messages]

        def render_and_encode() -> list[int]:
            text = template.render(
                messages,
                add_generation_prompt=req.add_generation_prompt,
                tools=req.tools,
                **extra,
            )
            # The template writes BOS itself where the model wants one (as HF does), so
            # no special tokens are added: the encoder's contract.
            return self._prompt_encoder.encode(text, cache_salt)

        size = prompt_chars + tools_chars + MESSAGE_COST_CHARS * len(req.messages)
        token_ids = await _maybe_offload(size, render_and_encode)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        pre = self._build(req, token_ids, max_tokens, max_param, "messages", logprobs, cache_salt)
        pre.structured = structured
        return pre

    # ---------------------------------------------------------------- completions

    async def preprocess_completion(
        self, req: CompletionRequest, tenant: str | None = None
    ) -> PreprocessedRequest:
        """``tenant``: as ``preprocess_chat``'s."""
        cache_salt = self._validate(req, req.max_tokens, "max_tokens", tenant)
        if req.best_of is not None and req.best_of != 1:
            raise RequestError("'best_of' other than 1 is not supported yet", param="best_of")
        if req.suffix:
            raise RequestError("'suffix' is not supported", param="suffix")
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise RequestError("'logprobs' must be between 0 and 5", param="logprobs")
        self._check_response(req, req.max_tokens, "max_tokens", req.logprobs or 0, "prompt")
        if req.logprobs is not None:
            self._require_logprobs(req.logprobs, "logprobs")
        if req.echo and (req.n or 1) > 1:
            raise RequestError("'echo' with 'n' > 1 is not supported yet", param="echo")
        prompt = self._single_prompt(req.prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("'prompt' must not be empty", param="prompt")
            self._check_fits(len(prompt), req.max_tokens, "max_tokens", "prompt")
        else:
            self._check_length(len(prompt), req.max_tokens, "max_tokens", "prompt")
        structured = await _maybe_offload(source_chars(req), structured_output, self.card, req)
        if isinstance(prompt, str):
            token_ids = await _maybe_offload(len(prompt), self.tokenizer.encode, prompt, True)
        else:
            token_ids = self._check_ids(prompt)
        pre = self._build(
            req, token_ids, req.max_tokens, "max_tokens", "prompt", req.logprobs, cache_salt
        )
        pre.structured = structured
        return pre

    @staticmethod
    def _single_prompt(prompt: Any) -> str | list[int]:
        """One prompt out of OpenAI's four shapes; several prompts (a batch) are refused."""
        if isinstance(prompt, str):
            return prompt
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("'prompt' must not be empty", param="prompt")
        first = prompt[0]
        if all(type(t) is int for t in prompt):
            return prompt
        if isinstance(first, str | list) and all(type(p) is type(first) for p in prompt):
            if len(prompt) > 1:
                raise RequestError("batched prompts are not supported", param="prompt")
            if isinstance(first, str):
                return first
            if first and all(type(t) is int for t in first):
                return first
            raise RequestError(
                "'prompt' token lists must be non-empty lists of integers", param="prompt"
            )
        raise RequestError(
            "'prompt' must be a string, a list of strings, a list of token ids, "
            "or a list of token-id lists",
            param="prompt",
        )

    def _check_ids(self, ids: list[int]) -> list[int]:
        n = self.tokenizer.vocab_size
        for t in ids:
            if not 0 <= t < n:
                raise RequestError(
                    f"token id {t} in 'prompt' is out of range for this model (0..{n - 1})",
                    param="prompt",
                )
        return list(ids)

    # ---------------------------------------------------------------- capabilities

    def _require_logprobs(self, alternatives: int, param: str) -> None:
        caps = self.card.capabilities
        if not caps.logprobs:
            raise RequestError(
                f"model '{self.card.display_name}' cannot return log probabilities "
                f"(its engine does not report them)",
                param=param,
            )
        if alternatives > caps.max_top_logprobs:
            raise RequestError(
                f"model '{self.card.display_name}' returns at most {caps.max_top_logprobs} "
                f"alternatives per token, not {alternatives}",
                param=param,
            )

    def _check_chat_features(self, req: ChatCompletionRequest) -> None:
        """Tools: honoured where the model's engine can, else a 400. (``tool_choice`` that
        forces calls is a structured output: ``structured_output`` checks it.)"""
        if req.tool_choice is not None and not req.tools:
            raise RequestError(
                "'tool_choice' is only allowed when 'tools' are specified", param="tool_choice"
            )
        if (
            req.tools
            and req.tool_choice in (None, "auto")
            and self.card.capabilities.tool_call_parser is None
        ):
            raise RequestError(
                f"model '{self.card.display_name}' has no tool-call parser, so a tool call "
                "would come back as plain text; send tool_choice 'none' to pass tools as "
                "context only",
                param="tools",
            )

    # ---------------------------------------------------------------- shared

    def _validate(
        self, req: _Request, max_tokens: int | None, max_param: str, tenant: str | None
    ) -> str | None:
        """Refuse what ``req`` may not ask of this model, before any expensive step; return
        its cache salt (``llm.cache_salt``: ``tenant``'s space, the client's salt within it)."""
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(
                f"'{max_param}' must be at least 1, got {max_tokens}", param=max_param
            )
        limits = self.limits
        limits.check_choices(req.n)
        limits.check_seed(req.seed, req.n)
        limits.check_stop(req.stop)
        limits.check_stop_token_ids(req.stop_token_ids, self.tokenizer.vocab_size)
        if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
            raise RequestError(
                f"'temperature' must be between 0 and 2, got {req.temperature}",
                param="temperature",
            )
        if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
            raise RequestError(
                f"'top_p' must be greater than 0 and at most 1, got {req.top_p}", param="top_p"
            )
        if req.logit_bias:
            raise RequestError(
                "'logit_bias' is not supported: no engine applies it yet", param="logit_bias"
            )
        if req.min_tokens is not None:
            if req.min_tokens < 0:
                raise RequestError("'min_tokens' must be at least 0", param="min_tokens")
            if req.min_tokens > 0 and not self.card.capabilities.min_tokens:
                raise RequestError(
                    f"model '{self.card.display_name}' cannot honour 'min_tokens' (its engine "
                    "does not hold back stops)",
                    param="min_tokens",
                )
            if max_tokens is not None and req.min_tokens > max_tokens:
                raise RequestError(
                    f"'min_tokens' ({req.min_tokens}) must not exceed '{max_param}' ({max_tokens})",
                    param="min_tokens",
                )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(req, name)
            if value is not None and not -2.0 <= value <= 2.0:
                raise RequestError(f"'{name}' must be between -2 and 2, got {value}", param=name)
        if req.top_k is not None and req.top_k < -1:
            raise RequestError("'top_k' must be -1 (disabled) or positive", param="top_k")
        if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
            raise RequestError("'min_p' must be between 0 and 1", param="min_p")
        if req.repetition_penalty is not None and req.repetition_penalty <= 0:
            raise RequestError("'repetition_penalty' must be positive", param="repetition_penalty")
        return request_cache_salt(req, tenant, self.card)

    def _check_response(
        self,
        req: _Request,
        max_tokens: int | None,
        max_param: str,
        alternatives: int,
        prompt_param: str,
    ) -> None:
        """The response's size within ``max_response_items``, before any expensive step (a
        request without ``max_tokens`` is capped instead, in ``_build``). A ``max_tokens``
        that does not fit the context anyway is refused for that, the more telling reason."""
        limits = self.limits
        n_tokens = max_tokens or 1
        if limits.response_items(req.n, n_tokens, alternatives) > limits.max_response_items:
            self._check_length(1, max_tokens, max_param, prompt_param, at_least=True)
        limits.check_response(req.n, n_tokens, alternatives, max_param)

    def _check_length(
        self,
        n_prompt: int,
        max_tokens: int | None,
        max_param: str,
        prompt_param: str,
        *,
        at_least: bool = False,
    ) -> None:
        """A prompt of ``n_prompt`` tokens (``at_least``: or more), and ``max_tokens`` more,
        within the context length."""
        ctx = self.card.context_length
        has = f"at least {n_prompt}" if at_least else str(n_prompt)
        if n_prompt >= ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, your prompt "
                f"has {has} tokens. Please reduce the length of the {prompt_param}.",
                param=prompt_param,
            )
        if max_tokens is not None and n_prompt + max_tokens > ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{'at least ' if at_least else ''}{n_prompt + max_tokens} tokens ({has} in "
                f"the {prompt_param}, {max_tokens} in the completion). Please reduce the "
                f"length of the {prompt_param} or '{max_param}'.",
                param=prompt_param,
            )

    def _check_fits(
        self, chars: int, max_tokens: int | None, max_param: str, prompt_param: str
    ) -> None:
        """Refuse, before templating or tokenizing, a prompt of ``chars`` characters that
        cannot fit however it tokenizes: it is at least ``chars / max_token_chars`` tokens.
        Short prompts skip it: tokenizing them is cheap, and their exact count makes the
        exact message."""
        if chars <= OFFLOAD_THRESHOLD_CHARS:
            return
        per_token = self.tokenizer.max_token_chars
        fewest = -(-chars // per_token)
        self._check_length(fewest, max_tokens, max_param, prompt_param, at_least=True)

    def _build(
        self,
        req: _Request,
        token_ids: list[int],
        max_tokens: int | None,
        max_param: str,
        prompt_param: str,
        logprobs: int | None,
        cache_salt: str | None,
    ) -> PreprocessedRequest:
        n_prompt = len(token_ids)
        self._check_length(n_prompt, max_tokens, max_param, prompt_param)
        if max_tokens is None:
            # The rest of the context, within the response budget (``max_response_items``).
            cap = self.limits.max_tokens_within(req.n, logprobs or 0)
            max_tokens = min(self.card.context_length - n_prompt, cap)
        if req.min_tokens is not None and req.min_tokens > max_tokens:
            raise RequestError(
                f"'min_tokens' ({req.min_tokens}) must not exceed the tokens left to generate "
                f"({max_tokens})",
                param="min_tokens",
            )

        nvext = req.nvext
        stop = req.stop
        stop_list = [stop] if isinstance(stop, str) else list(stop or ())
        stop_list = [s for s in stop_list if s]
        ignore_eos = bool(req.ignore_eos) or bool(nvext and nvext.ignore_eos)
        temperature = req.temperature
        if nvext is not None and nvext.greed_sampling:
            temperature = 0.0
        skip_special = True if req.skip_special_tokens is None else req.skip_special_tokens
        return PreprocessedRequest(
            model=req.model,
            token_ids=token_ids,
            stop_conditions=StopConditions(
                max_tokens=max_tokens,
                stop=stop_list or None,
                stop_token_ids_hidden=list(req.stop_token_ids) if req.stop_token_ids else None,
                min_tokens=req.min_tokens,
                ignore_eos=ignore_eos,
            ),
            sampling_options=SamplingOptions(
                n=req.n,
                temperature=temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                seed=req.seed,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
            ),
            output_options=OutputOptions(logprobs=logprobs, skip_special_tokens=skip_special),
            eos_token_ids=list(self.card.eos_token_ids),
            lora_name=self.card.lora.name if self.card.lora else None,
            backend_instance_id=nvext.pinned_instance if nvext else None,
            cache_salt=cache_salt,
            mdc_sum=self._mdc_sum,
        )


__all__ = ["OFFLOAD_THRESHOLD_CHARS", "Preprocessor"]
