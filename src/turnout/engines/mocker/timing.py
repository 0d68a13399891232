"""How long a simulated engine step takes: a small, replaceable model.

A step runs a batch that mixes prefill chunks (new, uncached prompt tokens) and decodes (one
token for each running request). The default model is fitted to a mid-size model on one GPU
(the shape Dynamo's mocker uses):

* prefill: ``prefill_ms(T) = 4.21e-7·T² + 0.01518·T + 16.5`` for ``T`` new tokens: a fixed
  launch cost, a linear term (the MLPs) and a quadratic one (attention over the chunk).
* decode: ``decode_ms(B, u) = 12.55 + 54.01·u - 25.74·u² + 0.01·B`` where ``u`` is the KV
  cache utilisation in [0, 1]: decode is memory bound, so it grows with the KV read per step,
  and only slightly with the batch size ``B``.
* a mixed step (prefill tokens and decodes together) costs ``prefill_ms(T + B)``: the decodes
  ride along as extra tokens of the same forward pass.

Swap the model by passing any object with these two methods (``TimingModel``) to the engine.
``--speedup-ratio`` is applied by the engine, not here: a model states GPU milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class TimingModel(Protocol):
    """GPU milliseconds of the parts of one step. Pure functions of their arguments."""

    def prefill_ms(self, new_tokens: int) -> float: ...

    def decode_ms(self, batch_size: int, kv_usage: float) -> float: ...


@dataclass(frozen=True, slots=True)
class PolynomialTimingModel:
    """The default model (see the module docstring); coefficients are fields to refit."""

    prefill_quadratic: float = 4.21e-7
    prefill_linear: float = 0.01518
    prefill_constant: float = 16.5
    decode_constant: float = 12.55
    decode_linear: float = 54.01
    decode_quadratic: float = -25.74
    decode_per_seq: float = 0.01

    def prefill_ms(self, new_tokens: int) -> float:
        t = float(new_tokens)
        return self.prefill_quadratic * t * t + self.prefill_linear * t + self.prefill_constant

    def decode_ms(self, batch_size: int, kv_usage: float) -> float:
        u = min(max(kv_usage, 0.0), 1.0)
        return (
            self.decode_constant
            + self.decode_linear * u
            + self.decode_quadratic * u * u
            + self.decode_per_seq * batch_size
        )


def step_ms(model: TimingModel, prefill_tokens: int, num_decodes: int, kv_usage: float) -> float:
    """GPU milliseconds of one step; 0 when the step does nothing."""
    if prefill_tokens > 0:
        return model.prefill_ms(prefill_tokens + num_decodes)
    if num_decodes > 0:
        return model.decode_ms(num_decodes, kv_usage)
    return 0.0
