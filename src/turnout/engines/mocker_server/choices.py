"""One choice of a response, from engine outputs to what every face writes: text pieces,
the ids behind them, log probabilities and how the choice ended.

``run_choice`` iterates a ``Generation``, turns ids into text (``TextStream``: detokenizer
and stop strings) and yields one ``Delta`` per engine output. A stop string ends the choice
on the HTTP side: the rest of the generation is aborted on the engine (its blocks freed), and
it is counted as a stop. Several choices (a batch of prompts) are interleaved by
``merge_choices`` through one bounded queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from turnout.engines.mocker_server.backend import Generation, engine_error
from turnout.engines.mocker_server.text import TextStream
from turnout.frontend.http.errors import SERVER_ERROR, HttpError
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.llm import FinishReason, LLMEngineOutput


@dataclass(slots=True)
class Delta:
    """What one engine output added to a choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: ``stop`` or ``length`` on the choice's last delta, else None.
    finish_reason: str | None = None
    #: What ended a ``stop``: the EOS or stop token id, or the stop string.
    matched: int | str | None = None
    #: The stop was the model's own EOS (vLLM reports no ``stop_reason`` for it).
    is_eos: bool = False
    #: On the last delta: prompt tokens, and those served from the prefix cache.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


async def run_choice(index: int, generation: Generation, text: TextStream) -> AsyncIterator[Delta]:
    """The deltas of one choice; an engine failure mid-stream raises its ``HttpError``."""
    async for out in generation:
        reason = out.finish_reason
        if reason is FinishReason.ERROR:
            raise engine_error(out)
        if reason is FinishReason.CANCELLED:
            raise HttpError(
                503, "the engine dropped the request", type=SERVER_ERROR, code="service_unavailable"
            )
        piece = text.feed(out.token_ids)
        delta = Delta(index, piece, out.token_ids, out.log_probs, out.top_logprobs)
        if text.stopped_by is not None:
            generation.stopped_early()
            delta.finish_reason = "stop"
            delta.matched = text.stopped_by
            _final(delta, generation)
            yield delta
            return
        if reason is not None:
            delta.text += text.finish()
            _finish(delta, out, reason)
            if text.stopped_by is not None:  # the last ids completed a stop string
                delta.finish_reason, delta.matched, delta.is_eos = "stop", text.stopped_by, False
            _final(delta, generation)
            yield delta
            return
        yield delta


def _finish(delta: Delta, out: LLMEngineOutput, reason: FinishReason) -> None:
    if reason is FinishReason.LENGTH:
        delta.finish_reason = "length"
        return
    delta.finish_reason = "stop"
    delta.is_eos = reason is FinishReason.EOS
    delta.matched = out.token_ids[-1] if out.token_ids else None


def _final(delta: Delta, generation: Generation) -> None:
    delta.prompt_tokens = generation.num_prompt_tokens
    delta.cached_tokens = generation.cached_tokens
    delta.completion_tokens = generation.num_output_tokens


async def merge_choices(runs: Sequence[AsyncIterator[Delta]]) -> AsyncIterator[Delta]:
    """The deltas of several choices as they come (one choice: passed straight through)."""
    if len(runs) == 1:
        async for delta in runs[0]:
            yield delta
        return
    queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue(maxsize=2 * len(runs))

    async def pump(run: AsyncIterator[Delta]) -> None:
        try:
            async for delta in run:
                await queue.put(delta)
            await queue.put(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(run), name="mocker-server-choice") for run in runs]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------- log probabilities


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer, delta: Delta, offset: int
) -> tuple[dict[str, Any], int]:
    """Legacy completions' ``logprobs`` object for ``delta``'s tokens, its text offsets
    starting at ``offset``; and the offset after them."""
    tokens: list[str] = []
    offsets: list[int] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    logprobs = delta.logprobs or []
    alternatives = delta.top_logprobs
    for i, token_id in enumerate(delta.token_ids):
        token = token_text(tokenizer, token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        values.append(logprobs[i] if i < len(logprobs) else None)
        if alternatives is not None and i < len(alternatives):
            tops.append({token_text(tokenizer, t): lp for t, lp in alternatives[i]})
        else:
            tops.append(None)
    body = {
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": tokens,
        "top_logprobs": tops,
    }
    return body, offset


def chat_logprobs(tokenizer: Tokenizer, delta: Delta) -> dict[str, Any]:
    """Chat's ``logprobs`` object (``content``: one entry per token) for ``delta``."""
    content = []
    logprobs = delta.logprobs or []
    alternatives = delta.top_logprobs
    for i, token_id in enumerate(delta.token_ids):
        token = token_text(tokenizer, token_id)
        tops = []
        if alternatives is not None and i < len(alternatives):
            for alt_id, alt_lp in alternatives[i]:
                alt = token_text(tokenizer, alt_id)
                tops.append({"token": alt, "logprob": alt_lp, "bytes": list(alt.encode())})
        content.append(
            {
                "token": token,
                "logprob": logprobs[i] if i < len(logprobs) else -9999.0,
                "bytes": list(token.encode()),
                "top_logprobs": tops,
            }
        )
    return {"content": content, "refusal": None}
