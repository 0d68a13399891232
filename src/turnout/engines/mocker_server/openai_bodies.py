"""The bodies of the OpenAI routes, as each engine writes them: whole responses and SSE
chunks of completions and chat completions (see ``openai_api`` for the fields each engine
adds), built from the ``Delta`` stream of their choices."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from turnout.engines.mocker_server.app import SseStream, error_event, send_json
from turnout.engines.mocker_server.backend import GenerateParams
from turnout.engines.mocker_server.choices import Delta, chat_logprobs, completion_logprobs
from turnout.engines.mocker_server.metrics import Api
from turnout.frontend.http.errors import HttpError
from turnout.llm.tokenizer import Tokenizer
from turnout.runtime.http import Exchange


class OpenAIWriter:
    """Writes one face's OpenAI responses. Stateless between requests."""

    def __init__(self, api: Api, tokenizer: Tokenizer) -> None:
        self.api = api
        self.tokenizer = tokenizer

    def usage(self, deltas: list[Delta]) -> dict[str, Any]:
        prompt = sum(d.prompt_tokens for d in deltas)
        completion = sum(d.completion_tokens for d in deltas)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in deltas)},
        }

    def stop_fields(self, delta: Delta | None) -> dict[str, Any]:
        if self.api is Api.VLLM:
            stop = None if delta is None or delta.is_eos else delta.matched
            return {"stop_reason": stop}
        return {"matched_stop": None if delta is None else delta.matched}

    async def whole_completion(
        self,
        exchange: Exchange,
        head: dict[str, Any],
        deltas: AsyncIterator[Delta],
        params: list[GenerateParams],
        return_ids: bool,
    ) -> None:
        tokenizer = self.tokenizer
        texts: list[list[str]] = [[] for _ in params]
        ids: list[list[int]] = [[] for _ in params]
        logprobs: list[dict[str, list[Any]] | None] = [None for _ in params]
        offsets = [0 for _ in params]
        finals: list[Delta | None] = [None for _ in params]
        async for delta in deltas:
            i = delta.index
            texts[i].append(delta.text)
            ids[i].extend(delta.token_ids)
            if params[i].logprobs is not None:
                part, offsets[i] = completion_logprobs(tokenizer, delta, offsets[i])
                merged = logprobs[i]
                if merged is None:
                    logprobs[i] = part
                else:
                    for key, values in part.items():
                        merged[key].extend(values)
            if delta.finish_reason is not None:
                finals[i] = delta
        choices = []
        for i, final in enumerate(finals):
            choice: dict[str, Any] = {
                "index": i,
                "text": "".join(texts[i]),
                "logprobs": logprobs[i],
                "finish_reason": final.finish_reason if final else "stop",
                **self.stop_fields(final),
            }
            if self.api is Api.VLLM:
                choice["prompt_logprobs"] = None
                choice["prompt_token_ids"] = params[i].token_ids if return_ids else None
                choice["token_ids"] = ids[i] if return_ids else None
            choices.append(choice)
        usage = self.usage([f for f in finals if f is not None])
        send_json(
            exchange, {**head, "choices": choices, "usage": usage, "system_fingerprint": None}
        )

    async def stream_completion(
        self,
        exchange: Exchange,
        head: dict[str, Any],
        deltas: AsyncIterator[Delta],
        params: list[GenerateParams],
        *,
        include_usage: bool,
        continuous: bool,
        return_ids: bool,
    ) -> None:
        tokenizer = self.tokenizer
        sse = SseStream(exchange)
        sent_prompt = [False for _ in params]
        offsets = [0 for _ in params]
        generated = [0 for _ in params]
        finals: list[Delta] = []
        try:
            async for delta in deltas:
                i = delta.index
                generated[i] += len(delta.token_ids)
                logprobs = None
                if params[i].logprobs is not None:
                    logprobs, offsets[i] = completion_logprobs(tokenizer, delta, offsets[i])
                choice: dict[str, Any] = {
                    "index": i,
                    "text": delta.text,
                    "logprobs": logprobs,
                    "finish_reason": delta.finish_reason,
                    **self.stop_fields(delta if delta.finish_reason else None),
                }
                if self.api is Api.VLLM:
                    first = return_ids and not sent_prompt[i]
                    sent_prompt[i] = True
                    choice["prompt_token_ids"] = params[i].token_ids if first else None
                    choice["token_ids"] = delta.token_ids if return_ids else None
                chunk: dict[str, Any] = {**head, "choices": [choice]}
                if self.api is Api.SGLANG:
                    chunk["usage"] = None
                if continuous:
                    prompt = len(params[i].token_ids)
                    chunk["usage"] = {
                        "prompt_tokens": prompt,
                        "completion_tokens": generated[i],
                        "total_tokens": prompt + generated[i],
                    }
                await sse.send(chunk)
                if delta.finish_reason is not None:
                    finals.append(delta)
            if include_usage:
                await sse.send({**head, "choices": [], "usage": self.usage(finals)})
        except HttpError as err:
            await sse.send_raw(error_event(err))
        await sse.done()

    async def whole_chat(
        self,
        exchange: Exchange,
        head: dict[str, Any],
        deltas: AsyncIterator[Delta],
        params: GenerateParams,
        want_logprobs: bool,
        return_ids: bool,
    ) -> None:
        tokenizer = self.tokenizer
        texts: list[str] = []
        ids: list[int] = []
        content: list[Any] = []
        final: Delta | None = None
        async for delta in deltas:
            texts.append(delta.text)
            ids.extend(delta.token_ids)
            if want_logprobs:
                content.extend(chat_logprobs(tokenizer, delta)["content"])
            if delta.finish_reason is not None:
                final = delta
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(texts),
            "tool_calls": [],
            "reasoning_content": None,
        }
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": {"content": content, "refusal": None} if want_logprobs else None,
            "finish_reason": final.finish_reason if final else "stop",
            **self.stop_fields(final),
        }
        response: dict[str, Any] = {
            **head,
            "choices": [choice],
            "usage": self.usage([final] if final else []),
        }
        if self.api is Api.VLLM:
            choice["token_ids"] = ids if return_ids else None
            response["prompt_token_ids"] = params.token_ids if return_ids else None
        send_json(exchange, response)

    async def stream_chat(
        self,
        exchange: Exchange,
        head: dict[str, Any],
        deltas: AsyncIterator[Delta],
        params: GenerateParams,
        *,
        want_logprobs: bool,
        include_usage: bool,
        continuous: bool,
        return_ids: bool,
    ) -> None:
        tokenizer = self.tokenizer
        head = {**head, "object": "chat.completion.chunk"}
        sse = SseStream(exchange)
        prompt = len(params.token_ids)
        generated = 0
        final: Delta | None = None
        first: dict[str, Any] = {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if return_ids:
            first["prompt_token_ids"] = params.token_ids
        try:
            await sse.send(first)
            async for delta in deltas:
                generated += len(delta.token_ids)
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": {"content": delta.text},
                    "logprobs": chat_logprobs(tokenizer, delta) if want_logprobs else None,
                    "finish_reason": delta.finish_reason,
                    **self.stop_fields(delta if delta.finish_reason else None),
                }
                if return_ids:
                    choice["token_ids"] = delta.token_ids
                chunk: dict[str, Any] = {**head, "choices": [choice]}
                if continuous:
                    chunk["usage"] = {
                        "prompt_tokens": prompt,
                        "completion_tokens": generated,
                        "total_tokens": prompt + generated,
                    }
                await sse.send(chunk)
                if delta.finish_reason is not None:
                    final = delta
            if include_usage:
                await sse.send(
                    {**head, "choices": [], "usage": self.usage([final] if final else [])}
                )
        except HttpError as err:
            await sse.send_raw(error_event(err))
        await sse.done()
