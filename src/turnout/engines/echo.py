"""The echo engine: streams the prompt's own token ids back, one output per token.

What it is for: measuring the frontend's and the planes' overhead with no model in the way
(benchmarks), and giving tests of cancellation, migration and timing an engine whose output is
known in advance. So the hot loop is lean: no per-token allocation beyond the output itself,
no task per token, and with ``delay_ms=0`` it only yields to the event loop every
``_YIELD_EVERY`` tokens.

Semantics, per request (``n`` = ``len(token_ids)``):

* ``max_tokens`` unset: the prompt is echoed once, ``n`` outputs, the last with ``EOS``.
* ``max_tokens = m``: exactly ``m`` outputs, cycling through the prompt when ``m > n``; the
  last has ``LENGTH``.
* The echo is verbatim: eos / stop token ids inside the prompt are echoed like any other
  token (as Dynamo's echo engine does); stopping on them is the frontend backend's job.
* With ``delay_ms > 0`` it sleeps that long before each token: a fake decode step.
* ``ctx.cancel()`` ends the stream at the next token (or at once, during a delay) with a
  ``CANCELLED`` output; closing the generator ends it too.
* Back-pressure is the generator's own: each token is made when the consumer asks for it
  (the pacing delay runs between asks, not ahead of them), so a consumer that stops reading
  stops the echo, and nothing is buffered here (the worker's output buffer bounds what it
  pulls ahead).

Every stream ends with ``usage`` (``cached_tokens=0``: there is no cache to hit). So no
request is served another's cached prefix, and the card's default ``cache_salt`` capability
(True) is truthful: a tenant's salted request runs like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from turnout.llm.model_card import default_gguf_path, load_model_card
from turnout.protocols.llm import (
    CompletionUsage,
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
)
from turnout.protocols.model import EndpointId, ModelDeploymentCard
from turnout.runtime.context import RequestContext

from .base import Engine

#: With no delay, give the event loop a turn this often (tokens), so one long echo cannot
#: starve other requests, heartbeats and cancellations.
_YIELD_EVERY = 16

#: The endpoint written into template cards; the worker replaces it (and ``instance_id``).
PLACEHOLDER_ENDPOINT = EndpointId(namespace="placeholder", component="placeholder", name="generate")


class EchoEngine(Engine):
    """Echo the prompt's tokens (see the module docstring for the exact semantics).

    ``model_path`` (an HF directory or a ``.gguf`` file; default: the SmolLM2 GGUF) only
    supplies the model card, i.e. the tokenizer (served to frontends as an artifact) and the
    chat template the frontend uses.
    ``context_length`` overrides the card's and makes longer prompts an ``ERROR`` output.
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        delay_ms: float = 0.0,
        context_length: int | None = None,
    ) -> None:
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        if context_length is not None and context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {context_length}")
        self.model_path = model_path
        self.delay_s = delay_ms / 1000.0
        self.context_length = context_length
        self._card: ModelDeploymentCard | None = None

    async def start(self) -> None:
        # Reading the model's metadata and building its tokenizer artifact is blocking: do it
        # off the loop, once.
        self._card = await asyncio.to_thread(self._load_card)

    def model_card_template(self) -> ModelDeploymentCard:
        if self._card is None:
            self._card = self._load_card()
        return self._card

    def _load_card(self) -> ModelDeploymentCard:
        path: str | Path = self.model_path or default_gguf_path()
        return load_model_card(
            path,
            endpoint=PLACEHOLDER_ENDPOINT,
            context_length=self.context_length,
        )

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        prompt = request.token_ids
        n_prompt = len(prompt)
        if self.context_length is not None and n_prompt >= self.context_length:
            yield _error(
                f"prompt has {n_prompt} tokens; the context length is {self.context_length}",
                n_prompt,
            )
            return
        max_tokens = request.stop_conditions.max_tokens
        if max_tokens is None:
            total, last_reason = n_prompt, FinishReason.EOS
        else:
            total, last_reason = max(max_tokens, 0), FinishReason.LENGTH
        if total > 0 and n_prompt == 0:
            yield _error("cannot echo an empty prompt", 0)
            return
        if total == 0:
            yield LLMEngineOutput(finish_reason=last_reason, usage=_usage(n_prompt, 0))
            return

        delay = self.delay_s
        last = total - 1
        for i in range(total):
            if delay:
                # Sleep, but wake at once if the request is cancelled meanwhile.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ctx.wait_cancelled(), delay)
            elif i % _YIELD_EVERY == _YIELD_EVERY - 1:
                await asyncio.sleep(0)
            if ctx.is_cancelled:
                yield LLMEngineOutput(
                    finish_reason=FinishReason.CANCELLED, usage=_usage(n_prompt, i)
                )
                return
            token = prompt[i % n_prompt]
            if i == last:
                yield LLMEngineOutput(
                    token_ids=[token], finish_reason=last_reason, usage=_usage(n_prompt, total)
                )
            else:
                yield LLMEngineOutput(token_ids=[token])


def _usage(prompt_tokens: int, completion_tokens: int) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=0
    )


def _error(message: str, prompt_tokens: int) -> LLMEngineOutput:
    """A request echo can never serve (``bad_request``: HTTP 400 at the frontend)."""
    return LLMEngineOutput(
        finish_reason=FinishReason.ERROR,
        error=message,
        error_kind=ErrorKind.BAD_REQUEST.value,
        usage=_usage(prompt_tokens, 0),
    )


__all__ = ["PLACEHOLDER_ENDPOINT", "EchoEngine"]
