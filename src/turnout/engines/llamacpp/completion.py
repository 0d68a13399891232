"""llama.cpp's completion API, as the in-process engine speaks it: the body of a streamed
completion built from a ``PreprocessedRequest`` (``make_body``), the chunks llama.cpp streams
back (``Chunk``, only the fields read), the slot it runs on (``pin_slot``), and the checks a
request's grammar must pass before llama.cpp may run it (``request_grammar_problem``)."""

from __future__ import annotations

import math
from typing import Any, Final

import msgspec

from turnout.llm.structured import grammar_problem
from turnout.protocols.llm import PreprocessedRequest

#: Most alternatives per token a request may ask for (OpenAI's limit for chat).
MAX_TOP_LOGPROBS: Final = 20

#: Structured outputs llama.cpp enforces (every kind: they all arrive as one grammar).
STRUCTURED_OUTPUTS: Final = ("json_object", "json_schema", "regex", "choice", "grammar")

#: ``SamplingOptions`` field -> llama.cpp completion parameter.
SAMPLING_KEYS: Final = (
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("seed", "seed"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repeat_penalty"),
)


# -- llama.cpp's chunks: only the fields read (msgspec skips the rest without building them)


class Alternative(msgspec.Struct):
    id: int
    logprob: float | None = None


class TokenLogprob(msgspec.Struct):
    id: int
    bytes: list[int] = []
    logprob: float | None = None
    top_logprobs: list[Alternative] = []


class Logprobs(msgspec.Struct):
    content: list[TokenLogprob] = []


class Choice(msgspec.Struct):
    text: str = ""
    finish_reason: str | None = None
    logprobs: Logprobs | None = None


class PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptDetails | None = None


class Timings(msgspec.Struct):
    #: Prompt tokens served from the slot's prompt cache.
    cache_n: int | None = None
    #: Prompt tokens computed, and the milliseconds from the start of prompt processing to
    #: the first token.
    prompt_n: int | None = None
    prompt_ms: float | None = None
    #: Tokens generated so far (1 at the first token) and the milliseconds since the first.
    predicted_n: int | None = None
    predicted_ms: float | None = None


class ErrorBody(msgspec.Struct):
    message: str = "unknown llama.cpp error"
    type: str | None = None


class Chunk(msgspec.Struct):
    choices: list[Choice] = []
    usage: Usage | None = None
    timings: Timings | None = None
    #: A refused request: ``{"error": {...}}``.
    error: ErrorBody | None = None
    #: A failure mid-stream arrives as a bare ``{"code", "message", "type"}``.
    message: str | None = None


decode_chunk = msgspec.json.Decoder(Chunk).decode
_encode = msgspec.json.Encoder().encode


def make_body(request: PreprocessedRequest) -> bytes:
    """The streamed completion llama.cpp runs for ``request`` (JSON), but for its slot: the
    slot is chosen when the request starts, and ``pin_slot`` adds it."""
    sc = request.stop_conditions
    body: dict[str, Any] = {
        "prompt": request.token_ids,
        "stream": True,
        "n_predict": -1 if sc.max_tokens is None else sc.max_tokens,
        # Every token's own log probability comes with its entry; alternatives: as many
        # as asked.
        "n_probs": max(1, request.output_options.logprobs or 0),
        "timings_per_token": True,
    }
    if sc.ignore_eos:
        body["ignore_eos"] = True
    if request.structured is not None:
        # llama.cpp compiles llguidance grammars itself (the "%llguidance" header).
        body["grammar"] = request.structured.grammar
    so = request.sampling_options
    for ours, theirs in SAMPLING_KEYS:
        value = getattr(so, ours)
        if value is not None:
            body[theirs] = value
    return _encode(body)


def pin_slot(body: bytes, slot: int, reuse: bool) -> bytes:
    """``body`` (a JSON object from ``make_body``) run on llama.cpp's slot ``slot``, reusing
    that slot's cached prompt prefix only when ``reuse``. Appended to the encoded body rather
    than encoded with it: the slot is known only when a pool thread starts the request, and
    the prompt's token ids are the bulk of the body."""
    reuse_json = b"true" if reuse else b"false"
    return b'%s,"id_slot":%d,"cache_prompt":%s}' % (body[:-1], slot, reuse_json)


def alternatives(entry: TokenLogprob, k: int) -> list[tuple[int, float]]:
    """An entry's ``k`` most likely alternatives, most likely first (-inf when llama.cpp gave
    no number)."""
    alts = [(a.id, -math.inf if a.logprob is None else a.logprob) for a in entry.top_logprobs]
    alts.sort(key=lambda a: -a[1])
    return alts[:k]


def request_grammar_problem(request: PreprocessedRequest) -> str:
    """Why llama.cpp must not run ``request``'s grammar ("" when it may, or has none).

    llama.cpp, given an llguidance grammar it cannot compile, logs it and samples freely: the
    answer would be a 200 with text that matches nothing. The frontend checks grammars before
    sending them; this check, with the same library, covers what reaches the worker another
    way (another frontend's version, a client of the request plane)."""
    structured = request.structured
    if structured is None:
        return ""
    if structured.kind not in STRUCTURED_OUTPUTS:
        return f"llama.cpp cannot enforce {structured.kind} output"
    if not structured.grammar.startswith("%llguidance"):
        # llama.cpp would read it as GBNF, which is not what the protocol carries.
        return "the grammar is not an llguidance grammar (no '%llguidance' header)"
    problem = grammar_problem(structured.grammar)
    return f"the {structured.kind} grammar does not compile: {problem}" if problem else ""
