"""Tensor engines (Tensor + TensorBased): named numeric tensors in, named tensors out.

A tensor engine declares its inputs and outputs (``TensorModelSpec``, published in its card
for frontends to check requests against); ``compute`` maps input arrays to output arrays
and runs in a worker thread, one request at a time, with at most ``max_waiting`` requests
queued behind it (more are refused as ``overloaded``). The engine checks inputs against its
spec again, since a request may reach it without passing a frontend's check.
"""

from __future__ import annotations

import abc
import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from turnout.engines.base import UnaryEngine, UnaryFailure
from turnout.protocols.llm import ErrorKind
from turnout.protocols.model import (
    DEVICE_CPU,
    EndpointId,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    RuntimeConfig,
)
from turnout.protocols.unary import (
    NUMPY_DTYPES,
    DataType,
    Tensor,
    TensorModelSpec,
    TensorOutput,
    TensorRequest,
    tensor_problem,
)
from turnout.runtime.context import RequestContext

_PLACEHOLDER = EndpointId(namespace="placeholder", component="placeholder", name="generate")


def to_array(tensor: Tensor) -> np.ndarray:
    """The tensor's elements as an array of its shape (read-only, no copy)."""
    dtype = np.dtype(NUMPY_DTYPES[tensor.datatype])
    return np.frombuffer(tensor.data, dtype=dtype).reshape(tensor.shape)


def from_array(name: str, datatype: DataType, array: np.ndarray) -> Tensor:
    data = np.ascontiguousarray(array, dtype=np.dtype(NUMPY_DTYPES[datatype])).tobytes()
    return Tensor(name=name, datatype=datatype, shape=list(array.shape), data=data)


class TensorEngine(UnaryEngine[TensorRequest, TensorOutput]):
    request_type = TensorRequest
    reply_type = TensorOutput

    def __init__(self, name: str, *, max_waiting: int = 64) -> None:
        self.name = name
        self.max_waiting = max_waiting
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tensor")
        self._waiting = 0

    @abc.abstractmethod
    def spec(self) -> TensorModelSpec:
        """The model's inputs and outputs (valid once started)."""

    @abc.abstractmethod
    def compute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every output, by name (runs in a worker thread)."""

    async def stop(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def model_card_template(self) -> ModelDeploymentCard:
        return ModelDeploymentCard(
            display_name=self.name,
            endpoint=_PLACEHOLDER,
            instance_id=0,
            model_type=ModelType.TensorBased,
            model_input=ModelInput.Tensor,
            runtime_config=RuntimeConfig(max_num_seqs=1, device_type=DEVICE_CPU),
            tensor=self.spec(),
        )

    async def run(self, request: TensorRequest, ctx: RequestContext) -> TensorOutput:
        spec = self.spec()
        problem = tensor_problem(spec, request.inputs)
        if problem is not None:
            raise UnaryFailure(f"{problem[0]}: {problem[1]}", ErrorKind.BAD_REQUEST)
        declared = {t.name: t for t in spec.outputs}
        wanted = request.outputs or list(declared)
        unknown = [name for name in wanted if name not in declared]
        if unknown:
            raise UnaryFailure(f"the model has no output {unknown[0]!r}", ErrorKind.BAD_REQUEST)
        if self._waiting >= self.max_waiting:
            raise UnaryFailure(
                f"{self._waiting} requests are waiting (the limit)", ErrorKind.OVERLOADED
            )
        arrays = {t.name: to_array(t) for t in request.inputs}
        self._waiting += 1
        try:
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(self._thread, self.compute, arrays)
        finally:
            self._waiting -= 1
        return TensorOutput(
            outputs=[from_array(name, declared[name].datatype, results[name]) for name in wanted]
        )
