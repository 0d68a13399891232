"""Bursts (several ids in one engine output, as a worker merges them) decode exactly like the
same ids sent one output per id; and the worker's merge keeps every id and the finish."""

from __future__ import annotations

import pytest

from turnout.engines.worker import merge_outputs
from turnout.llm.backend import StreamDecoder
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.llm import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)

TEXT = "Hello wörld 🎉 and   spaces\n\n1234 end 😀"


def _request(tok: Tokenizer, **stop: object) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m",
        token_ids=tok.encode("prompt"),
        stop_conditions=StopConditions(**stop),  # type: ignore[arg-type]
        sampling_options=SamplingOptions(),
        output_options=OutputOptions(),
        eos_token_ids=[tok.eos_token_id] if tok.eos_token_id is not None else [],
    )


def _run(tok: Tokenizer, req: PreprocessedRequest, outputs: list[LLMEngineOutput]):
    dec = StreamDecoder(tok, req)
    deltas = [dec.step(o) for o in outputs]
    return "".join(d.text for d in deltas), dec.finish_reason, dec.num_output_tokens


@pytest.mark.parametrize("burst", [2, 5, 16])
@pytest.mark.parametrize(
    ("stop", "finish"),
    [({}, FinishReason.EOS), ({"max_tokens": 7}, FinishReason.LENGTH),
     ({"max_tokens": 6}, FinishReason.LENGTH), ({"stop": ["and"]}, FinishReason.EOS)],
)  # fmt: skip
def test_burst_decodes_like_single_steps(
    smol_tokenizer: Tokenizer, burst: int, stop: dict, finish: FinishReason
) -> None:
    tok = smol_tokenizer
    ids = tok.encode(TEXT)
    singles = [LLMEngineOutput(token_ids=[t]) for t in ids]
    singles[-1] = LLMEngineOutput(token_ids=[ids[-1]], finish_reason=finish)
    body = ids[:-1]  # the last id comes with the finish, as an engine sends it
    bursts = [
        *(LLMEngineOutput(token_ids=body[i : i + burst]) for i in range(0, len(body), burst)),
        singles[-1],
    ]
    req = _request(tok, **stop)
    assert _run(tok, req, bursts) == _run(tok, req, singles)
    # the worker's merge of the whole stream: one output with every id and the finish
    assert _run(tok, req, merge_outputs(singles)) == _run(tok, req, singles)


def test_merge_outputs_keeps_ids_order_and_finish() -> None:
    usage = CompletionUsage(prompt_tokens=3, completion_tokens=5)
    outs = [
        LLMEngineOutput(token_ids=[1]),
        LLMEngineOutput(token_ids=[2, 3]),
        LLMEngineOutput(token_ids=[4], text="x"),  # text: cannot absorb the run
        LLMEngineOutput(token_ids=[5]),
        LLMEngineOutput(token_ids=[6], finish_reason=FinishReason.LENGTH, usage=usage),
    ]
    merged = merge_outputs(outs)
    assert merged == [
        LLMEngineOutput(token_ids=[1, 2, 3]),
        LLMEngineOutput(token_ids=[4], text="x"),
        LLMEngineOutput(token_ids=[5, 6], finish_reason=FinishReason.LENGTH, usage=usage),
    ]
    assert merge_outputs(outs[:1]) == outs[:1]
    assert merge_outputs([LLMEngineOutput(token_ids=[1]), LLMEngineOutput(token_ids=[2])]) == [
        LLMEngineOutput(token_ids=[1, 2])
    ]
