"""Request traces for routing benchmarks: a seeded multi-turn generator and a Mooncake loader.

A trace is a list of ``TraceRequest`` in arrival order. A prompt is not stored as tokens but
as *segments*: ``(kind, key, length)`` triples, each standing for ``length`` token ids drawn
from a RNG seeded by ``(token_seed, kind, key)``. Equal segments therefore expand to equal
tokens, and two prompts share exactly the prefix their segment lists share::

    turn 0   [system k][user 7]                           input_length = sum of the lengths
    turn 1   [system k][user 7][answer 8][user 9]         (turn 0's prompt is its prefix)
    mooncake [hash 41 ][hash 42 ][hash 97 ]  -> truncated to input_length

So a trace of thousands of long prompts is small in memory, and the tokens are rebuilt
deterministically wherever they are needed (the HTTP replay, the oracle).

* ``generate_sessions(SyntheticTraceConfig)``: N sessions, each on one of K long shared system
  prompts, T turns each; turn ``t`` appends a user message to turn ``t - 1``'s prompt and the
  answer it got (of that request's output length). Sessions start as a Poisson process;
  turns follow after exponential think times.
* ``load_mooncake(path)``: Mooncake's JSONL (``timestamp`` in ms, ``input_length``,
  ``output_length``, ``hash_ids`` of 512-token blocks); ``window_start`` and ``max_requests``
  choose a contiguous window of its lines. Its requests carry no session
  (``Trace.has_sessions`` is False).
* ``oracle_hit_rate(trace, block_size)``: the prefix-cache hit rate of one worker with an
  unlimited cache that sees every request: the ceiling any router can reach.

Token ids are drawn from ``[1000, 40000)``: inside SmolLM2's 49152-token vocabulary, clear of
its special tokens (which sit at the low ids).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from turnout.protocols.block_hashing import compute_block_hashes

#: Token ids are drawn uniformly from ``[TOKEN_LOW, TOKEN_HIGH)``.
TOKEN_LOW = 1000
TOKEN_HIGH = 40000
#: Tokens per ``hash_ids`` entry in Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512


class SegmentKind(enum.IntEnum):
    """Key spaces of segments: equal keys of different kinds are different text."""

    MOONCAKE_BLOCK = 0
    SYSTEM_PROMPT = 1
    USER_TEXT = 2
    ANSWER = 3
    #: Tokens a Mooncake record's ``input_length`` claims beyond its ``hash_ids`` (unique).
    PADDING = 4


@dataclass(frozen=True, slots=True)
class Segment:
    """``length`` deterministic token ids named by ``(kind, key)``."""

    kind: SegmentKind
    key: int
    length: int


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    The prompt is the concatenation of ``segments``' tokens, cut to ``input_length``.
    """

    #: Seconds after the trace's start at which the request is sent (before time scaling).
    arrival_s: float
    session_id: str
    #: Turn within its session (0 for traces without sessions).
    turn: int
    input_length: int
    output_length: int
    segments: tuple[Segment, ...]


@dataclass(slots=True)
class Trace:
    """Requests sorted by arrival, how their tokens are drawn, and how the trace was made."""

    kind: str
    requests: list[TraceRequest]
    #: Seed of the token expansion (``segment_tokens``).
    token_seed: int
    #: Every parameter that made the trace (generator config with its seed, or the file).
    params: dict[str, Any] = field(default_factory=dict)
    #: Whether ``session_id`` names a real conversation (a client would send it as a
    #: session hint); False where every request is its own "session" (Mooncake).
    has_sessions: bool = True

    @property
    def span_s(self) -> float:
        """Seconds from the first arrival to the last (0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def prompt_tokens(self, request: TraceRequest) -> np.ndarray:
        """The request's prompt token ids (int32), rebuilt from its segments."""
        return expand_segments(request.segments, request.input_length, self.token_seed)

    def get_summary(self) -> dict[str, Any]:
        """Counts and sizes, for the benchmark's output."""
        reqs = self.requests
        if not reqs:
            return {"num_requests": 0}
        inputs = [r.input_length for r in reqs]
        outputs = [r.output_length for r in reqs]
        duration = reqs[-1].arrival_s - reqs[0].arrival_s
        return {
            "num_requests": len(reqs),
            "num_sessions": len({r.session_id for r in reqs}),
            "duration_s": round(duration, 3),
            "request_rate_per_s": round(len(reqs) / duration, 3) if duration > 0 else None,
            "input_tokens_total": int(sum(inputs)),
            "input_tokens_mean": round(float(np.mean(inputs)), 1),
            "input_tokens_max": int(max(inputs)),
            "output_tokens_mean": round(float(np.mean(outputs)), 1),
            "output_tokens_max": int(max(outputs)),
        }


@functools.lru_cache(maxsize=4096)
def _segment_tokens_cached(token_seed: int, kind: int, key: int, length: int) -> np.ndarray:
    rng = np.random.default_rng([token_seed, kind, key])
    tokens = rng.integers(TOKEN_LOW, TOKEN_HIGH, size=length, dtype=np.int32)
    tokens.flags.writeable = False  # shared by the cache
    return tokens


def segment_tokens(segment: Segment, token_seed: int) -> np.ndarray:
    """The token ids of one segment: a pure function of ``(token_seed, kind, key, length)``.

    Read-only (results are cached: Mooncake traces repeat hash ids a lot).
    """
    if segment.key < 0 or segment.length < 0:
        raise ValueError(f"segment key and length must be >= 0, got {segment}")
    return _segment_tokens_cached(token_seed, int(segment.kind), segment.key, segment.length)


def expand_segments(segments: Sequence[Segment], input_length: int, token_seed: int) -> np.ndarray:
    """Concatenate the segments' tokens and cut the result to ``input_length``."""
    if not segments:
        return np.zeros(0, dtype=np.int32)
    tokens = np.concatenate([segment_tokens(s, token_seed) for s in segments])
    if len(tokens) < input_length:
        raise ValueError(f"segments hold {len(tokens)} tokens, fewer than {input_length}")
    return tokens[:input_length]


# ------------------------------------------------------------------------------- synthetic


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticTraceConfig:
    """Parameters of ``generate_sessions``; all of them go into the benchmark's output.

    Lengths are inclusive ``(min, max)`` ranges drawn uniformly; times are trace seconds.
    """

    num_sessions: int = 64
    num_system_prompts: int = 16
    system_prompt_tokens: tuple[int, int] = (1024, 4096)
    turns_per_session: tuple[int, int] = (2, 6)
    user_tokens: tuple[int, int] = (64, 512)
    output_tokens: tuple[int, int] = (16, 96)
    #: Sessions start as a Poisson process of this rate (sessions per second).
    session_rate: float = 1.0
    #: Mean of the exponential gap between a session's turns (seconds).
    think_time_s: float = 8.0
    seed: int = 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad parameter."""
        for name in ("num_sessions", "num_system_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("system_prompt_tokens", "turns_per_session", "user_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= min <= max, got {(lo, hi)}")
        if not (math.isfinite(self.session_rate) and self.session_rate > 0):
            raise ValueError(f"session_rate must be > 0, got {self.session_rate}")
        if not (math.isfinite(self.think_time_s) and self.think_time_s >= 0):
            raise ValueError(f"think_time_s must be >= 0, got {self.think_time_s}")

    def to_dict(self) -> dict[str, Any]:
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }


def generate_sessions(config: SyntheticTraceConfig) -> Trace:
    """A multi-turn chat trace: a pure function of ``config`` (its ``seed`` included)."""
    config.validate()
    rng = random.Random(config.seed)

    def draw(bounds: tuple[int, int]) -> int:
        return rng.randint(bounds[0], bounds[1])

    system_lengths = [draw(config.system_prompt_tokens) for _ in range(config.num_system_prompts)]
    keys = iter(range(1 << 62))  # user and answer segments are each unique
    requests: list[TraceRequest] = []
    session_start = 0.0
    for s in range(config.num_sessions):
        session_start += rng.expovariate(config.session_rate)
        k = rng.randrange(config.num_system_prompts)
        segments: list[Segment] = [Segment(SegmentKind.SYSTEM_PROMPT, k, system_lengths[k])]
        length = system_lengths[k]
        at = session_start
        for turn in range(draw(config.turns_per_session)):
            if turn > 0 and config.think_time_s > 0:
                at += rng.expovariate(1.0 / config.think_time_s)
            user = Segment(SegmentKind.USER_TEXT, next(keys), draw(config.user_tokens))
            segments.append(user)
            length += user.length
            output = draw(config.output_tokens)
            requests.append(
                TraceRequest(
                    arrival_s=at,
                    session_id=f"s{s}",
                    turn=turn,
                    input_length=length,
                    output_length=output,
                    segments=tuple(segments),
                )
            )
            # The next turn carries this answer (of the length the model will produce).
            segments.append(Segment(SegmentKind.ANSWER, next(keys), output))
            length += output
    requests.sort(key=lambda r: r.arrival_s)  # stable: a session's turns keep their order
    return Trace(
        kind="synthetic", requests=requests, token_seed=config.seed, params=config.to_dict()
    )


# -------------------------------------------------------------------------------- mooncake


def load_mooncake(
    path: str | Path,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    window_start: int = 0,
    max_requests: int | None = None,
    max_input_length: int | None = None,
    max_output_length: int | None = None,
    token_seed: int = 0,
) -> Trace:
    """Load a Mooncake JSONL trace (one request a line).

    Each line has ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``
    (one id per ``block_tokens`` tokens of the prompt; equal ids are equal blocks). The trace
    is the window of ``max_requests`` records (all when None) from record ``window_start``
    (0-based, blank lines not counted); arrivals are taken relative to the window's earliest
    timestamp. ``max_input_length`` cuts long prompts
    (keeping their prefixes, so sharing is preserved) and ``max_output_length`` caps outputs;
    tokens the hash ids do not cover are filled with tokens unique to the request; an output
    length of 0 becomes 1. Raises ``ValueError`` naming the bad line.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
    if window_start < 0:
        raise ValueError(f"window_start must be >= 0, got {window_start}")
    raw: list[tuple[float, int, int, list[int]]] = []
    record = -1
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record += 1
            if record < window_start:
                continue
            if max_requests is not None and len(raw) >= max_requests:
                break
            raw.append(_parse_mooncake_line(line, lineno, path))
    if window_start and not raw:
        raise ValueError(f"{path}: window_start {window_start} is past its {record + 1} records")
    num_truncated = 0
    num_padded = 0
    requests: list[TraceRequest] = []
    t0 = min((r[0] for r in raw), default=0.0)
    for i, (timestamp_ms, input_length, output_length, hash_ids) in enumerate(raw):
        if max_input_length is not None and input_length > max_input_length:
            input_length = max_input_length
            num_truncated += 1
        needed_blocks = -(-input_length // block_tokens)
        segments = [
            Segment(SegmentKind.MOONCAKE_BLOCK, h, block_tokens) for h in hash_ids[:needed_blocks]
        ]
        covered = len(segments) * block_tokens
        if covered < input_length:
            segments.append(Segment(SegmentKind.PADDING, window_start + i, input_length - covered))
            num_padded += 1
        requests.append(
            TraceRequest(
                arrival_s=(timestamp_ms - t0) / 1000.0,
                session_id=f"r{window_start + i}",
                turn=0,
                input_length=input_length,
                output_length=max(1, min(output_length, max_output_length or output_length)),
                segments=tuple(segments),
            )
        )
    requests.sort(key=lambda r: r.arrival_s)
    params = {
        "file": str(path),
        "block_tokens": block_tokens,
        "window_start": window_start,
        "max_requests": max_requests,
        "max_input_length": max_input_length,
        "max_output_length": max_output_length,
        "token_seed": token_seed,
        "num_truncated": num_truncated,
        "num_padded": num_padded,
    }
    return Trace(
        kind="mooncake",
        requests=requests,
        token_seed=token_seed,
        params=params,
        has_sessions=False,
    )


def _parse_mooncake_line(
    line: str, lineno: int, path: str | Path
) -> tuple[float, int, int, list[int]]:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    missing = [
        k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj
    ]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    timestamp, input_length, output_length, hash_ids = (
        obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    )  # fmt: skip
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool):
        raise ValueError(f"{where}: timestamp must be a number (ms), got {timestamp!r}")
    for name, value in (("input_length", input_length), ("output_length", output_length)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: {name} must be an integer >= 0, got {value!r}")
    if input_length < 1:
        raise ValueError(f"{where}: input_length must be at least 1")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
    return float(timestamp), input_length, output_length, hash_ids


# ---------------------------------------------------------------------------------- oracle


@dataclass(frozen=True, slots=True)
class OracleResult:
    """What an unlimited prefix cache would have served from cache over a whole trace."""

    block_size: int
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens even the oracle must prefill: the least prefill work of any router."""
        return self.prompt_tokens - self.cached_tokens


def oracle_hit_rate(trace: Trace, block_size: int) -> OracleResult:
    """Replay ``trace`` in arrival order through one cache that never evicts.

    A request's cached tokens are its longest prefix of full ``block_size`` blocks already
    seen (by their chained sequence hashes, as the workers name them); then all its full
    blocks are remembered. No router over any number of finite workers can beat this.
    """
    seen: set[int] = set()
    prompt_tokens = 0
    cached_tokens = 0
    for request in trace.requests:
        tokens = trace.prompt_tokens(request)
        prompt_tokens += len(tokens)
        _, sequence = compute_block_hashes(tokens, block_size)
        hits = _count_prefix_hits(sequence, seen)
        cached_tokens += hits * block_size
        seen.update(sequence)
    return OracleResult(block_size, prompt_tokens, cached_tokens)


def _count_prefix_hits(sequence_hashes: Iterable[int], seen: set[int]) -> int:
    hits = 0
    for h in sequence_hashes:
        if h not in seen:
            break
        hits += 1
    return hits
