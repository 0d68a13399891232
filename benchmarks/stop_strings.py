"""The stop-string jail alone: CPU per streamed token, and the cost of setting it up.

A response of ordinary text (SmolLM2's tokens, one token a step, as the frontend streams) runs
through ``StreamDecoder.step`` with no stop strings, with two short ones (the common case),
with sixteen, and with stop strings that keep matching part way (the text is full of their
first characters, so the jail holds and releases on most tokens). Set-up: the time to make a
decoder for one stop string of L characters (what a request pays before its first token).
Prints a table, writes JSON.

Usage::

    python benchmarks/stop_strings.py [--rounds 20] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from turnout.llm.backend import Backend
from turnout.llm.model_card import default_gguf_path
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.llm import (
    LLMEngineOutput,
    OutputOptions,
    PreprocessedRequest,
    StopConditions,
)
from turnout.runtime.progress import track

ROOT = Path(__file__).resolve().parent.parent
TEXT = "The weather in Paris is mild today, with a light breeze and some sun. 😀 " * 40
CASES: dict[str, list[str] | None] = {
    "no stop strings": None,
    "2 short stops": ["</s>", "Observation:"],
    "16 stops": [f"<|stop{i}|>" for i in range(16)],
    "2 stops, frequent partial matches": ["e w!", "ther in Paris is cold"],
}
SETUP_LENGTHS = (16, 256, 4096, 20_000)


def _request(tok: Tokenizer, stop: list[str] | None) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m",
        token_ids=tok.encode("prompt"),
        stop_conditions=StopConditions(stop=stop, ignore_eos=True),
        output_options=OutputOptions(),
    )


def per_token(tok: Tokenizer, stop: list[str] | None, rounds: int) -> float:
    """Median over rounds of the mean seconds per ``step``."""
    ids = tok.encode(TEXT)
    outs = [LLMEngineOutput(token_ids=[i]) for i in ids]
    backend = Backend(tok)
    samples = []
    for _ in range(rounds):
        dec = backend.decoder(_request(tok, stop))
        step = dec.step
        start = time.perf_counter()
        for o in outs:
            step(o)
        samples.append((time.perf_counter() - start) / len(outs))
    samples.sort()
    return samples[len(samples) // 2]


def setup(tok: Tokenizer, length: int) -> float:
    """Seconds to make a decoder for one stop string of ``length`` characters."""
    stop = ["ab" * (length // 2)]
    backend = Backend(tok)
    best = float("inf")
    for k in range(3):
        req = _request(tok, [stop[0] + str(k)])  # a new string each time: no cache hit
        start = time.perf_counter()
        backend.decoder(req)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/stop_strings.json")
    args = ap.parse_args()
    tok = Tokenizer.from_gguf(default_gguf_path())
    result: dict[str, dict[str, float]] = {"per_token_us": {}, "setup_ms": {}}
    print(f"{'case':40} {'µs/token':>10}")
    for label, stop in track(list(CASES.items()), "cases", label=lambda c: c[0]):
        us = per_token(tok, stop, args.rounds) * 1e6
        result["per_token_us"][label] = round(us, 3)
        print(f"{label:40} {us:10.2f}")
    print(f"\n{'one stop string of L chars':40} {'ms/decoder':>10}")
    for length in SETUP_LENGTHS:
        ms = setup(tok, length) * 1e3
        result["setup_ms"][str(length)] = round(ms, 3)
        print(f"{'L = ' + str(length):40} {ms:10.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
