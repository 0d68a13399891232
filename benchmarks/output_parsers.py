"""Output parsers alone: CPU per streamed token of each tool-call / reasoning parser.

Each model family's recorded-style output (reasoning, an answer, two tool calls) is cut into
the model's tokens (SmolLM2's tokenizer: the cut matters, not the vocabulary) and fed one
token at a time, as the frontend feeds a streamed response; also the plain-text case (a
parser that finds nothing), the frontend's common path. Prints a table, writes JSON.

Usage::

    python benchmarks/output_parsers.py [--rounds 300] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from turnout.llm.detokenizer import Detokenizer
from turnout.llm.model_card import default_gguf_path
from turnout.llm.parsers import make_output_parser
from turnout.llm.tokenizer import Tokenizer
from turnout.runtime.progress import track

ROOT = Path(__file__).resolve().parent.parent
ANSWER = "The weather in Paris is mild today, with a light breeze and some sun. " * 3
THINK = "The user asks about the weather; I should call the tool for Paris and then Oslo. " * 2
ARGS = ('{"city": "Paris"}', '{"city": "Oslo"}')
OUTPUTS = {
    "hermes": "".join(
        f'<tool_call>\n{{"name": "get_weather", "arguments": {a}}}\n</tool_call>\n' for a in ARGS
    ),
    "llama3_json": "; ".join(f'{{"name": "get_weather", "parameters": {a}}}' for a in ARGS),
    "mistral": "[TOOL_CALLS]"
    + json.dumps([{"name": "get_weather", "arguments": json.loads(a)} for a in ARGS]),
    "pythonic": '[get_weather(city="Paris"), get_weather(city="Oslo")]',
    "deepseek_v3": "<｜tool▁calls▁begin｜>"  # noqa: RUF001
    + "".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{a}\n```"  # noqa: RUF001
        "<｜tool▁call▁end｜>"  # noqa: RUF001
        for a in ARGS
    )
    + "<｜tool▁calls▁end｜>",  # noqa: RUF001
    "harmony": f"<|channel|>analysis<|message|>{THINK}<|end|>"
    + "".join(
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        f"<|message|>{a}<|call|>"
        for a in ARGS
    ),
}
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


def cases() -> list[tuple[str, str | None, str | None, str]]:
    """(label, tool-call parser, reasoning parser, output)."""
    out: list[tuple[str, str | None, str | None, str]] = [
        ("plain text, hermes", "hermes", None, ANSWER),
        ("plain text, qwen3", None, "qwen3", ANSWER),
        ("think tags, deepseek_r1", None, "deepseek_r1", THINK + "</think>" + ANSWER),
        ("think + hermes calls, qwen3 + hermes", "hermes", "qwen3",
         f"<think>{THINK}</think>" + OUTPUTS["hermes"]),
    ]  # fmt: skip
    for name, text in OUTPUTS.items():
        reasoning = "harmony" if name == "harmony" else None
        out.append((f"two calls, {name}", name, reasoning, text))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/output_parsers.json"))
    args = ap.parse_args()
    tok = Tokenizer.from_gguf(default_gguf_path())
    rows = []
    print(f"{'case':42} {'tokens':>6} {'us/response':>12} {'us/token':>9}")
    for label, tool, reasoning, text in track(list(cases()), "cases", label=lambda c: c[0]):
        # As the frontend decodes them: a character split across tokens comes whole.
        detok = Detokenizer(tok, skip_special_tokens=False)
        pieces = [p for p in (detok.step(i) for i in tok.encode(text, False)) if p]
        calls = 0
        start = time.process_time()
        for _ in range(args.rounds):
            parser = make_output_parser(tool_call_parser=tool, reasoning_parser=reasoning,
                                        tools=TOOLS)  # fmt: skip
            assert parser is not None
            for piece in pieces:
                calls += len(parser.feed(piece).tool_calls)
            calls += len(parser.finish().tool_calls)
        per_response = (time.process_time() - start) / args.rounds * 1e6
        assert calls in (0, 2 * args.rounds), f"{label}: {calls / args.rounds} calls"
        row = {"case": label, "tokens": len(pieces), "us_per_response": round(per_response, 1),
               "us_per_token": round(per_response / len(pieces), 2),
               "calls_per_response": calls / args.rounds}  # fmt: skip
        rows.append(row)
        print(f"{label:42} {len(pieces):>6} {per_response:>12.1f} {row['us_per_token']:>9.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
