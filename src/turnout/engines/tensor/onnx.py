"""Any ONNX model behind a worker, with ONNX Runtime: its graph's inputs and outputs become
the card's tensors (symbolic dimensions: -1).

With no path, the model is all-MiniLM-L6-v2's sentence-embedding graph (``input_ids`` and
``attention_mask`` INT64 ``[-1, -1]`` -> ``sentence_embedding`` FP32 ``[-1, 384]``), built
from the package that ships it: a real model that needs nothing downloaded.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from turnout.engines.ort import cpu_session
from turnout.errors import ConfigError
from turnout.protocols.unary import DataType, TensorModelSpec, TensorSpec

from .base import TensorEngine

#: ONNX Runtime's element type names -> KServe's.
ORT_TYPES = {
    "tensor(bool)": DataType.BOOL,
    "tensor(uint8)": DataType.UINT8,
    "tensor(uint16)": DataType.UINT16,
    "tensor(uint32)": DataType.UINT32,
    "tensor(uint64)": DataType.UINT64,
    "tensor(int8)": DataType.INT8,
    "tensor(int16)": DataType.INT16,
    "tensor(int32)": DataType.INT32,
    "tensor(int64)": DataType.INT64,
    "tensor(float16)": DataType.FP16,
    "tensor(float)": DataType.FP32,
    "tensor(double)": DataType.FP64,
}


class OnnxTensorEngine(TensorEngine):
    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        name: str | None = None,
        threads: int | None = None,
        max_waiting: int = 64,
    ) -> None:
        default = "all-MiniLM-L6-v2-onnx" if model_path is None else Path(model_path).stem
        super().__init__(name or default, max_waiting=max_waiting)
        self._path = Path(model_path) if model_path is not None else None
        self._threads = threads
        self._session: object | None = None
        self._spec: TensorModelSpec | None = None

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        if self._path is None:
            from turnout.engines.embeddings.model import SentenceEmbeddingModel

            graph: bytes | str = SentenceEmbeddingModel(run=False).graph
        elif self._path.is_file():
            graph = str(self._path)
        else:
            raise ConfigError(f"ONNX model {self._path} does not exist")
        try:
            session = cpu_session(graph, self._threads)
        except Exception as exc:  # ONNX Runtime raises its own types for unreadable models
            raise ConfigError(f"ONNX model {self._path}: {exc}") from None
        self._spec = TensorModelSpec(
            inputs=[_spec_of(arg, self._path) for arg in session.get_inputs()],
            outputs=[_spec_of(arg, self._path) for arg in session.get_outputs()],
        )
        self._session = session

    def spec(self) -> TensorModelSpec:
        assert self._spec is not None, "start() first"
        return self._spec

    def compute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self._session
        assert session is not None
        names = [t.name for t in self.spec().outputs]
        results = session.run(names, inputs)  # type: ignore[attr-defined]
        return dict(zip(names, results, strict=True))


def _spec_of(arg: object, path: Path | None) -> TensorSpec:
    kind = getattr(arg, "type", "")
    datatype = ORT_TYPES.get(kind)
    name = getattr(arg, "name", "?")
    if datatype is None:
        raise ConfigError(f"ONNX model {path}: tensor {name!r} has unsupported type {kind}")
    shape = [d if isinstance(d, int) and d >= 0 else -1 for d in getattr(arg, "shape", [])]
    return TensorSpec(name=name, datatype=datatype, shape=shape)
