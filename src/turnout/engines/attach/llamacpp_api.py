"""llama.cpp's server (``llama-server``, or ``xllamacpp.Server`` with a port) as a token-in/
token-out engine.

Read from llama.cpp's ``tools/server`` (``server-context.cpp``: ``process_token``,
``send_partial_response``, ``send_final_response``; ``server-task.cpp``: the params and the
JSON of results):

Request: ``POST /completion`` with ``prompt`` (a list of token ids), ``stream: true``,
``return_tokens: true`` (each event's ``tokens``), ``n_predict`` (-1: until the context is
full), ``cache_prompt: true``, ``n_probs`` (alternatives per token, with each token's own
``logprob``), ``ignore_eos``, and the samplers ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``repeat_penalty``.

Stream events (``data: {...}``): ``content`` (text), ``tokens`` (the one sampled id),
``tokens_predicted`` (generated so far), ``tokens_evaluated`` (prompt tokens),
``completion_probabilities`` (per token ``id``, ``logprob``, ``top_logprobs``), then a final
event with ``stop: true``, ``stop_type`` (``eos``, ``limit``, ``word``, ``none``) and
``timings`` (``cache_n``: prompt tokens served from the cache). A token whose bytes end
inside a UTF-8 character gets no event; the event that completes the character carries its
bytes in ``content`` and only the completing id in ``tokens``: the missing ids are rebuilt
from those bytes (``vocab.VocabBytes``), checked against ``tokens_predicted``. Tokens still
held back when generation ends are lost (they are not text either).

Refused: ``min_tokens`` (llama.cpp has no such parameter), ``cache_salt`` (its slots reuse
any earlier prompt's cache, so it cannot keep tenants apart).

Description: ``GET /props`` (``default_generation_settings.n_ctx`` is the context of one
slot, ``total_slots``, ``model_path``), ``GET /v1/models`` (the served id). llama.cpp has no
KV block size: the card uses ``DEFAULT_BLOCK_SIZE`` unless ``--block-size`` says otherwise
(it only sizes the router's prefix hashing: llama.cpp emits no KV events).

Load: ``GET /metrics`` (``llamacpp:requests_processing``, ``llamacpp:requests_deferred``;
the server needs ``--metrics``), else ``GET /slots`` (``is_processing``). KV usage is
estimated as busy slots over slots. Tokenizer probe: ``POST /tokenize`` ``{"content",
"add_special": false}`` -> ``{"tokens"}``.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import msgspec

from turnout.protocols.llm import FinishReason, PreprocessedRequest
from turnout.protocols.model import ModelCapabilities

from .api_base import (
    MAX_TOP_LOGPROBS,
    ChunkDecoder,
    ErrorBody,
    LoadNumbers,
    Piece,
    ServerInfo,
    TokensApi,
    decode_event,
    error_kind,
    require_dict,
    served_id,
    token_list,
)
from .prometheus import parse_samples
from .upstream import Upstream, UpstreamGarbage, UpstreamStatus
from .vocab import VocabBytes

log = logging.getLogger(__name__)

#: The card's KV block size for a llama.cpp server (it has none of its own).
DEFAULT_BLOCK_SIZE = 16

#: ``SamplingOptions`` field -> llama.cpp's parameter.
_SAMPLING = (
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("seed", "seed"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repeat_penalty"),
)


class _Alt(msgspec.Struct):
    id: int
    logprob: float | None = None


class _Prob(msgspec.Struct):
    id: int
    logprob: float | None = None
    top_logprobs: list[_Alt] = []


class _Timings(msgspec.Struct):
    cache_n: int | None = None


class _Event(msgspec.Struct):
    content: str = ""
    tokens: list[int] = []
    stop: bool = False
    stop_type: str | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    completion_probabilities: list[_Prob] = []
    timings: _Timings | None = None
    error: ErrorBody | str | None = None
    #: A failure mid-stream may come as a bare ``{"code", "message", "type"}``.
    message: str | None = None
    code: int | None = None
    type: str | None = None


_event_decoder = msgspec.json.Decoder(_Event)

_FINISH = {"eos": FinishReason.EOS, "limit": FinishReason.LENGTH, "word": FinishReason.STOP}


class _Decoder(ChunkDecoder):
    __slots__ = ("_url", "_vocab", "_want_logprobs", "_want_top", "seen")

    def __init__(self, url: str, request: PreprocessedRequest, vocab: VocabBytes) -> None:
        self._url = url
        self._vocab = vocab
        self._want_logprobs = request.output_options.logprobs is not None
        self._want_top = request.output_options.logprobs or 0
        #: Token ids delivered so far (events' ids plus recovered ones).
        self.seen = 0

    def feed(self, field: str, payload: bytes) -> Piece | None:
        if payload == b"[DONE]":
            return None
        event = decode_event(_event_decoder, self._url, payload)
        if field == "error" or event.error is not None or event.message is not None:
            err = event.error
            if not isinstance(err, ErrorBody):
                err = ErrorBody(
                    message=err or event.message or "", type=event.type, code=event.code
                )
            return Piece(error=(f"llama.cpp: {err.message or 'error'}", error_kind(err)))
        ids = list(event.tokens)
        missing = (event.tokens_predicted or 0) - self.seen - len(ids)
        recovered: list[int] = []
        if ids and missing > 0 and event.content:
            raw = event.content.encode()
            piece = self._vocab.piece(ids[0])
            if piece is not None and len(raw) > len(piece) and raw.endswith(piece):
                recovered = self._vocab.fill(raw[: len(raw) - len(piece)])
            if len(recovered) != missing:
                log.debug(
                    "llama.cpp held back %d tokens; %d rebuilt from their bytes",
                    missing,
                    len(recovered),
                )
        all_ids = recovered + ids
        self.seen += len(all_ids)
        lps: list[float] | None = None
        tops: list[list[tuple[int, float]]] | None = None
        probs = event.completion_probabilities
        if self._want_logprobs and all_ids:
            # Rebuilt tokens have no entry of their own (NaN, no alternatives).
            lps = [math.nan] * len(recovered)
            lps += [p.logprob if p.logprob is not None else math.nan for p in probs[: len(ids)]]
            lps += [math.nan] * (len(all_ids) - len(lps))
            if self._want_top:
                tops = [[] for _ in recovered]
                tops += [_top(p, self._want_top) for p in probs[: len(ids)]]
                tops += [[] for _ in range(len(all_ids) - len(tops))]
        finish: FinishReason | None = None
        if event.stop:
            finish = _FINISH.get(event.stop_type or "", FinishReason.STOP)
        return Piece(
            token_ids=all_ids,
            log_probs=lps,
            top_logprobs=tops,
            finish=finish,
            last=event.stop,
            prompt_tokens=event.tokens_evaluated,
            completion_tokens=event.tokens_predicted if event.stop else None,
            cached_tokens=event.timings.cache_n if event.timings is not None else None,
        )


def _top(prob: _Prob, k: int) -> list[tuple[int, float]]:
    alts = [(a.id, -math.inf if a.logprob is None else a.logprob) for a in prob.top_logprobs]
    alts.sort(key=lambda a: -a[1])
    return alts[:k]


class LlamaCppApi(TokensApi):
    name = "llamacpp"
    label = "llama.cpp"
    generate_path = "/completion"
    health_path = "/health"

    def __init__(self, url: str, vocab: VocabBytes | None = None) -> None:
        self.url = url
        self.vocab = vocab if vocab is not None else VocabBytes(())
        #: Whether ``/metrics`` answered (None: not tried yet); else ``/slots`` is read.
        self._metrics: bool | None = None
        self._slots = 1

    def capabilities(self) -> ModelCapabilities:
        # No ``cache_salt``: the frontend refuses salted requests (a tenant's among them)
        # before routing, ``own_refusal`` those that arrive anyway.
        return ModelCapabilities(logprobs=True, max_top_logprobs=MAX_TOP_LOGPROBS, cache_salt=False)

    async def describe(self, upstream: Upstream) -> ServerInfo:
        props = require_dict(upstream.base_url, "GET /props", await upstream.get_json("/props"))
        settings = props.get("default_generation_settings")
        if not isinstance(settings, dict) or not isinstance(settings.get("n_ctx"), int):
            raise UpstreamGarbage(
                upstream.base_url, "GET /props has no default_generation_settings.n_ctx"
            )
        n_ctx = int(settings["n_ctx"])
        slots = props.get("total_slots")
        self._slots = slots if isinstance(slots, int) and slots > 0 else 1
        path = props.get("model_path")
        served = served_id(upstream.base_url, await upstream.get_json("/v1/models"))
        if served is None or _looks_like_path(served):
            # llama-server names a model by its file unless given --alias: serve the stem,
            # as turnout's own llama.cpp worker does.
            source = served or (path if isinstance(path, str) else "model")
            served = os.path.splitext(os.path.basename(source))[0] or source
        return ServerInfo(
            api=self.name,
            served_name=served,
            context_length=n_ctx,
            block_size=None,
            total_kv_blocks=max(1, n_ctx * self._slots // DEFAULT_BLOCK_SIZE),
            max_num_seqs=self._slots,
            version=str(props.get("build_info")) if props.get("build_info") else None,
            model_path=path if isinstance(path, str) else None,
        )

    def own_refusal(self, request: PreprocessedRequest) -> str | None:
        if request.stop_conditions.min_tokens:
            return "min_tokens: llama.cpp's server has no such parameter"
        if request.cache_salt:
            return "cache_salt: llama.cpp cannot partition its prompt cache"
        return None

    def make_body(
        self, request: PreprocessedRequest, *, served_name: str, max_tokens: int, rid: str
    ) -> dict[str, object]:
        body: dict[str, Any] = {
            "prompt": request.token_ids,
            "stream": True,
            "return_tokens": True,
            "cache_prompt": True,
            "n_predict": max_tokens,
        }
        logprobs = request.output_options.logprobs
        if logprobs is not None:
            body["n_probs"] = max(1, logprobs)
        if request.stop_conditions.ignore_eos:
            body["ignore_eos"] = True
        so = request.sampling_options
        for ours, theirs in _SAMPLING:
            value = getattr(so, ours)
            if value is not None:
                body[theirs] = value
        return body

    def decoder(self, request: PreprocessedRequest) -> ChunkDecoder:
        return _Decoder(self.url, request, self.vocab)

    async def tokenize(self, upstream: Upstream, text: str) -> list[int]:
        answer = await upstream.post_json("/tokenize", {"content": text, "add_special": False})
        return token_list(upstream.base_url, "POST /tokenize", answer)

    async def load(self, upstream: Upstream) -> LoadNumbers:
        if self._metrics is not False:
            try:
                samples = parse_samples(
                    await upstream.get_text("/metrics"),
                    ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
                )
            except UpstreamStatus:
                self._metrics = False  # started without --metrics: read /slots instead
            else:
                self._metrics = True
                running = int(samples.total("llamacpp:requests_processing") or 0)
                waiting = int(samples.total("llamacpp:requests_deferred") or 0)
                return self._numbers(running, waiting)
        slots = await upstream.get_json("/slots")
        if not isinstance(slots, list):
            raise UpstreamGarbage(upstream.base_url, "GET /slots is not a list")
        running = sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))
        self._slots = max(self._slots, len(slots))
        return self._numbers(running, 0)

    def _numbers(self, running: int, waiting: int) -> LoadNumbers:
        return LoadNumbers(
            num_running=running,
            num_waiting=waiting,
            kv_usage=min(1.0, running / self._slots),
        )


def _looks_like_path(name: str) -> bool:
    return name.endswith(".gguf") or name.startswith(("/", "./", "~"))


__all__ = ["DEFAULT_BLOCK_SIZE", "LlamaCppApi"]
