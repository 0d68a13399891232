"""The routing benchmark's traces: the seeded session generator, the Mooncake loader, the oracle."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from benchmarks.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TOKEN_HIGH,
    TOKEN_LOW,
    Segment,
    SegmentKind,
    SyntheticTraceConfig,
    Trace,
    generate_sessions,
    load_mooncake,
    oracle_hit_rate,
    segment_tokens,
)

SMALL = SyntheticTraceConfig(
    num_sessions=12,
    num_system_prompts=3,
    system_prompt_tokens=(200, 600),
    turns_per_session=(2, 4),
    user_tokens=(10, 50),
    output_tokens=(5, 20),
    session_rate=2.0,
    think_time_s=3.0,
    seed=7,
)


def all_tokens(trace: Trace) -> list[list[int]]:
    return [trace.prompt_tokens(r).tolist() for r in trace.requests]


def write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ------------------------------------------------------------------------------- synthetic


def test_generator_is_a_pure_function_of_its_config() -> None:
    a, b = generate_sessions(SMALL), generate_sessions(SMALL)
    assert a.requests == b.requests
    assert all_tokens(a) == all_tokens(b)
    other = generate_sessions(SyntheticTraceConfig(**{**SMALL.to_dict(), "seed": 8}))  # type: ignore[arg-type]
    assert [r.arrival_s for r in other.requests] != [r.arrival_s for r in a.requests]
    assert all_tokens(other) != all_tokens(a)


def test_generator_records_every_parameter_and_the_seed() -> None:
    trace = generate_sessions(SMALL)
    assert trace.kind == "synthetic"
    assert trace.params == json.loads(json.dumps(SMALL.to_dict()))
    assert trace.params["seed"] == 7
    assert SyntheticTraceConfig(**{k: tuple(v) if isinstance(v, list) else v
                                   for k, v in trace.params.items()}) == SMALL  # fmt: skip


def test_sessions_grow_turn_by_turn_over_a_shared_system_prompt() -> None:
    trace = generate_sessions(SMALL)
    reqs = trace.requests
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    by_session: dict[str, list[int]] = {}
    for i, r in enumerate(reqs):
        by_session.setdefault(r.session_id, []).append(i)
    assert len(by_session) == SMALL.num_sessions
    system_prompts: dict[int, list[int]] = {}
    for indices in by_session.values():
        turns = [reqs[i] for i in indices]
        assert [t.turn for t in turns] == list(range(len(turns)))
        lo, hi = SMALL.turns_per_session
        assert lo <= len(turns) <= hi
        for prev, cur in itertools.pairwise(turns):
            # Turn t + 1 = turn t's prompt + its answer (of turn t's output length) + user text.
            grown = cur.input_length - prev.input_length - prev.output_length
            assert SMALL.user_tokens[0] <= grown <= SMALL.user_tokens[1]
            p, c = trace.prompt_tokens(prev), trace.prompt_tokens(cur)
            assert np.array_equal(c[: len(p)], p)
        system = turns[0].segments[0]
        prompt = trace.prompt_tokens(turns[0])[: system.length].tolist()
        assert system_prompts.setdefault(system.key, prompt) == prompt
    assert len(system_prompts) > 1  # several system prompts are in use...
    first = {k: v[:32] for k, v in system_prompts.items()}
    assert len({tuple(v) for v in first.values()}) == len(first)  # ...and they differ


def test_token_ids_stay_inside_the_vocabulary_and_clear_of_special_ids() -> None:
    trace = generate_sessions(SMALL)
    tokens = np.concatenate([trace.prompt_tokens(r) for r in trace.requests])
    assert tokens.min() >= TOKEN_LOW and tokens.max() < TOKEN_HIGH
    for r in trace.requests:
        assert len(trace.prompt_tokens(r)) == r.input_length
        assert SMALL.output_tokens[0] <= r.output_length <= SMALL.output_tokens[1]


def test_segments_of_different_kinds_or_keys_are_different_text() -> None:
    kinds = list(SegmentKind)
    blocks = {(k, key): segment_tokens(Segment(k, key, 64), 0) for k in kinds for key in (0, 1)}
    assert len({b.tobytes() for b in blocks.values()}) == len(blocks)
    again = segment_tokens(Segment(SegmentKind.USER_TEXT, 1, 64), 0)
    assert np.array_equal(again, blocks[SegmentKind.USER_TEXT, 1])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_sessions": 0}, "num_sessions"),
        ({"user_tokens": (50, 10)}, "user_tokens"),
        ({"session_rate": 0.0}, "session_rate"),
        ({"think_time_s": -1.0}, "think_time_s"),
    ],
)
def test_generator_rejects_bad_parameters(change: dict[str, object], message: str) -> None:
    config = SyntheticTraceConfig(**{**SMALL.to_dict(), **change})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        generate_sessions(config)


# -------------------------------------------------------------------------------- mooncake


def test_mooncake_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 1500, "input_length": 700, "output_length": 12, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 512, "output_length": 3, "hash_ids": [0]},
        {"timestamp": 4250, "input_length": 1100, "output_length": 0, "hash_ids": [0, 1, 2]},
    ])  # fmt: skip
    trace = load_mooncake(path)
    assert trace.kind == "mooncake"
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.5, 3.25]  # ms, from the first
    assert [r.input_length for r in trace.requests] == [512, 700, 1100]
    assert [r.output_length for r in trace.requests] == [3, 12, 1]  # at least one token
    assert [len(trace.prompt_tokens(r)) for r in trace.requests] == [512, 700, 1100]
    assert trace.params["file"] == str(path)
    capped = load_mooncake(path, max_output_length=5)
    assert [r.output_length for r in capped.requests] == [3, 5, 1]


def test_mooncake_equal_hash_ids_are_equal_token_blocks(tmp_path: Path) -> None:
    blocks = [[5, 6, 7], [5, 6, 8], [9, 6, 7], [5, 6]]
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": i, "input_length": MOONCAKE_BLOCK_TOKENS * len(ids),
         "output_length": 1, "hash_ids": ids}
        for i, ids in enumerate(blocks)
    ])  # fmt: skip
    trace = load_mooncake(path, token_seed=3)
    cut = {}  # (request, block index) -> that block's tokens
    for i, r in enumerate(trace.requests):
        tokens = trace.prompt_tokens(r)
        for b in range(len(blocks[i])):
            cut[i, b] = tokens[b * MOONCAKE_BLOCK_TOKENS : (b + 1) * MOONCAKE_BLOCK_TOKENS]
    for (i, b), x in cut.items():
        for (j, c), y in cut.items():
            # Same block content exactly when the hash ids are equal (position does not matter).
            assert np.array_equal(x, y) == (blocks[i][b] == blocks[j][c])
    other = load_mooncake(path, token_seed=4)
    assert not np.array_equal(other.prompt_tokens(other.requests[0]), cut[0, 0])


def test_mooncake_truncates_to_input_length_and_pads_uncovered_tokens(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 2, "input_length": 1300, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 3, "input_length": 1300, "output_length": 1, "hash_ids": [1, 2]},
    ])  # fmt: skip
    trace = load_mooncake(path)
    full, short, pad_a, pad_b = (trace.prompt_tokens(r) for r in trace.requests)
    assert np.array_equal(short, full[:1100])
    assert np.array_equal(pad_a[:1024], full[:1024])
    assert not np.array_equal(pad_a[1024:], pad_b[1024:])  # padding is unique per request
    assert trace.params["num_padded"] == 2
    capped = load_mooncake(path, max_input_length=600, max_requests=2)
    assert [r.input_length for r in capped.requests] == [600, 600]
    assert np.array_equal(capped.prompt_tokens(capped.requests[0]), full[:600])
    assert capped.params["num_truncated"] == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "t.jsonl:2: not JSON"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "missing field.*hash_ids"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [-1]}',
         "hash_ids"),
        ('{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": [1]}',
         "timestamp"),
    ],
)  # fmt: skip
def test_mooncake_bad_lines_are_named(tmp_path: Path, line: str, message: str) -> None:
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_mooncake(path)


# ---------------------------------------------------------------------------------- oracle


def test_oracle_counts_the_longest_seen_prefix_of_full_blocks(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 2, "input_length": 512, "output_length": 1, "hash_ids": [5]},
        {"timestamp": 3, "input_length": 1024, "output_length": 1, "hash_ids": [1, 9]},
        {"timestamp": 4, "input_length": 1024, "output_length": 1, "hash_ids": [9, 2]},
        {"timestamp": 5, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2]},
    ])  # fmt: skip
    result = oracle_hit_rate(load_mooncake(path), block_size=64)
    # cached: 0, 1024, 0, 512, 0 ([9, 2] is a new prefix), 960 (15 full blocks of 64).
    assert result.prompt_tokens == 1024 + 1536 + 512 + 1024 + 1024 + 1000
    assert result.cached_tokens == 1024 + 512 + 960
    assert result.hit_rate == pytest.approx(result.cached_tokens / result.prompt_tokens)


def test_oracle_on_sessions_reuses_system_prompts_and_history() -> None:
    trace = generate_sessions(SMALL)
    result = oracle_hit_rate(trace, block_size=16)
    # Every turn after the first reuses at least the whole previous prompt's full blocks.
    floor = sum(
        (p.input_length // 16) * 16
        for p in trace.requests
        for c in trace.requests
        if c.session_id == p.session_id and c.turn == p.turn + 1
    )
    assert floor <= result.cached_tokens < result.prompt_tokens


def test_mooncake_window_is_a_contiguous_slice_of_records(tmp_path: Path) -> None:
    records = [
        {"timestamp": 1000 * i, "input_length": 600, "output_length": 1, "hash_ids": [i % 3]}
        for i in range(10)
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" + ("\n" if i == 1 else "") for i, r in
                            enumerate(records)))  # fmt: skip
    whole = load_mooncake(path)
    window = load_mooncake(path, window_start=3, max_requests=4)
    # Records 3..6 (the blank line is not a record), arrivals from the window's first.
    assert [r.session_id for r in window.requests] == ["r3", "r4", "r5", "r6"]
    assert [r.arrival_s for r in window.requests] == [0.0, 1.0, 2.0, 3.0]
    assert window.span_s == 3.0 and whole.span_s == 9.0
    assert window.params["window_start"] == 3 and window.params["max_requests"] == 4
    assert not window.has_sessions and generate_sessions(SMALL).has_sessions
    # A record's tokens (its padding included) do not depend on the window it is read in.
    for r in window.requests:
        same = whole.requests[int(r.session_id[1:])]
        assert np.array_equal(window.prompt_tokens(r), whole.prompt_tokens(same))
    tail = load_mooncake(path, window_start=8, max_requests=5)
    assert [r.session_id for r in tail.requests] == ["r8", "r9"]
    with pytest.raises(ValueError, match="past its 10 records"):
        load_mooncake(path, window_start=10)
    with pytest.raises(ValueError, match="window_start"):
        load_mooncake(path, window_start=-1)


def test_oracle_uncached_tokens_are_what_it_could_not_serve() -> None:
    result = oracle_hit_rate(generate_sessions(SMALL), block_size=16)
    assert result.uncached_tokens == result.prompt_tokens - result.cached_tokens > 0
