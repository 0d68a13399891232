"""A deterministic tensor model for tests and benchmarks: exact, cheap, known in advance.

Input ``x``: FP32 ``[-1, -1]`` (rows of any length). Outputs: ``affine`` = ``2x + 1`` (FP32,
same shape), ``row_sum`` (FP64 ``[-1]``, each row's sum in double precision), ``argmax``
(INT64 ``[-1]``, each row's first largest element; -1 for an empty row).
"""

from __future__ import annotations

import numpy as np

from turnout.protocols.unary import DataType, TensorModelSpec, TensorSpec

from .base import TensorEngine

NUMERIC_SPEC = TensorModelSpec(
    inputs=[TensorSpec(name="x", datatype=DataType.FP32, shape=[-1, -1])],
    outputs=[
        TensorSpec(name="affine", datatype=DataType.FP32, shape=[-1, -1]),
        TensorSpec(name="row_sum", datatype=DataType.FP64, shape=[-1]),
        TensorSpec(name="argmax", datatype=DataType.INT64, shape=[-1]),
    ],
)


class NumericEngine(TensorEngine):
    def __init__(self, name: str = "numeric", *, max_waiting: int = 64) -> None:
        super().__init__(name, max_waiting=max_waiting)

    def spec(self) -> TensorModelSpec:
        return NUMERIC_SPEC

    def compute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        if x.shape[1] == 0:
            argmax = np.full(x.shape[0], -1, dtype=np.int64)
        else:
            argmax = np.argmax(x, axis=1).astype(np.int64)
        return {
            "affine": 2 * x + 1,
            "row_sum": x.astype(np.float64).sum(axis=1),
            "argmax": argmax,
        }
