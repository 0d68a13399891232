"""How long a simulated engine step takes: a small, replaceable model.

A step runs a batch that mixes prefill chunks (new, uncached prompt tokens) and decodes (one
token for each running request). The default model is Dynamo's mocker (1.6.1, vLLM engine
type, polynomial timing; ai-dynamo/aisimulate ``engine/common/perf_model.rs``), fitted to a
mid-size model on one GPU:

* prefill: ``prefill_ms(T) = 4.209989e-7·T² + 0.01518344·T + 16.50142`` for ``T`` new prompt
  tokens in the step: a fixed launch cost, a linear term (the MLPs) and a quadratic one
  (attention over the chunk).
* decode: ``decode_ms(u) = max(5.74 + 54.01·u - 25.74·u², 1)`` where ``u`` is the KV cache
  utilisation in [0, 1]: decode is memory bound, so it grows with the KV read per step, not
  with the batch size (Dynamo's polynomial ignores it; ``decode_per_seq`` is 0).
* a step costs ``prefill_ms(T) + decode_ms(u)`` when it has decodes (requests that already
  emitted a token), else ``prefill_ms(T)``: the prefill pass and the decode pass of a mixed
  step add up. A request whose prompt completes in a step emits its first token at the end
  of that step without a decode charge, so a lone request's TTFT is ``prefill_ms(P)``
  (chunked: the sum over its chunks) and its inter-token latency ``decode_ms(u)``.

Measured end to end against Dynamo 1.6.1 by ``benchmarks/mocker_calibration.py``; pinned by
``tests/engines/mocker/test_timing_calibration.py``. In Dynamo, ``u`` is the summed context
length of the decoding requests over the pool's token capacity (a shared prefix counts once
per request); the scheduler passes what it measures.

Swap the model by passing any object with these two methods (``TimingModel``) to the engine.
``--speedup-ratio`` is applied by the engine, not here: a model states GPU milliseconds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

#: Wall time as the engine sees it, and its way to wait: injectable, so tests run on a fake
#: clock whose sleeps return at once.
Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class TimingModel(Protocol):
    """GPU milliseconds of the parts of one step. Pure functions of their arguments."""

    def prefill_ms(self, new_tokens: int) -> float: ...

    def decode_ms(self, batch_size: int, kv_usage: float) -> float: ...


@dataclass(frozen=True, slots=True)
class PolynomialTimingModel:
    """The default model (see the module docstring); coefficients are fields to refit."""

    prefill_quadratic: float = 4.209989e-07
    prefill_linear: float = 1.518344e-02
    prefill_constant: float = 1.650142e01
    decode_constant: float = 5.74
    decode_linear: float = 54.01
    decode_quadratic: float = -25.74
    decode_per_seq: float = 0.0
    #: The least a decode step takes (Dynamo's floor, so token times never coincide).
    decode_floor: float = 1.0

    def prefill_ms(self, new_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        t = float(new_tokens)
        return self.prefill_quadratic * t * t + self.prefill_linear * t + self.prefill_constant

    def decode_ms(self, batch_size: int, kv_usage: float) -> float:
        u = min(max(kv_usage, 0.0), 1.0)
        ms = (
            self.decode_constant
            + self.decode_linear * u
            + self.decode_quadratic * u * u
            + self.decode_per_seq * batch_size
        )
        return max(ms, self.decode_floor)


def step_ms(model: TimingModel, prefill_tokens: int, num_decodes: int, kv_usage: float) -> float:
    """GPU milliseconds of one step: its prefill pass plus, when it has decodes, its decode
    pass (Dynamo's mocker adds them); 0 when the step does nothing."""
    ms = model.prefill_ms(prefill_tokens) if prefill_tokens > 0 else 0.0
    if num_decodes > 0:
        ms += model.decode_ms(num_decodes, kv_usage)
    return ms
