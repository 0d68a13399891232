"""``POST /v1/tensor``: named tensors in, named tensors out, for Tensor + TensorBased models.

The body is KServe v2's inference request, with the model named in it (one route serves
every tensor model)::

    {"model": "numeric", "id": "r1",
     "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3, 4]}],
     "outputs": [{"name": "affine", "parameters": {"binary_data": true}}]}

``data`` is the elements row-major: a flat (or nested) JSON list, or a string holding the
base64 of their little-endian bytes. Every input is checked against the model's card
(``TensorModelSpec``: names, datatypes, shapes with -1 for any length, element counts);
a mismatch is a 400 naming the field (``inputs[0].shape``). Outputs come back as JSON lists,
or as base64 strings where ``binary_data`` asks; ``outputs`` omitted: all of them.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np

from turnout.errors import RequestError, WorkerProtocolError
from turnout.frontend.http.surface import Surface
from turnout.frontend.models.manager import ModelKind
from turnout.frontend.models.pipeline import WorkerGate
from turnout.frontend.unary.base import apply_nvext, unary_surface
from turnout.protocols.model import ModelDeploymentCard
from turnout.protocols.openai import UnaryNvExt
from turnout.protocols.unary import (
    NUMPY_DTYPES,
    DataType,
    Tensor,
    TensorModelSpec,
    TensorOutput,
    TensorRequest,
    tensor_problem,
)
from turnout.router.push_router import InstanceSource
from turnout.router.unary import UnaryCaller
from turnout.runtime.context import RequestContext


class InputTensor(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    datatype: DataType
    shape: list[int]
    #: Elements row-major: a JSON list (flat or nested), or base64 of little-endian bytes.
    data: list[Any] | str


class OutputParameters(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: Return this output's data as base64 of its little-endian bytes.
    binary_data: bool = False


class RequestedOutput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    parameters: OutputParameters | None = None


class TensorInferRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    inputs: list[InputTensor]
    outputs: list[RequestedOutput] | None = None
    #: Echoed in the response (KServe's request id).
    id: str | None = None
    nvext: UnaryNvExt | None = None


class OutputTensor(msgspec.Struct, kw_only=True):
    name: str
    datatype: DataType
    shape: list[int]
    data: list[Any] | str


class TensorInferResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    model_name: str
    outputs: list[OutputTensor]
    id: str | None = None
    object: Literal["tensor"] = "tensor"


_decoder = msgspec.json.Decoder(TensorInferRequest)

#: The numpy kinds a JSON list may hold for each datatype family (ints may fill floats).
_KINDS = {"b": "b", "u": "iu", "i": "iu", "f": "iuf"}


def to_wire(tensor: InputTensor, index: int) -> Tensor:
    """The input as raw little-endian bytes; a 400 naming ``inputs[i].data`` when its
    elements are not numbers of its datatype."""
    dtype = np.dtype(NUMPY_DTYPES[tensor.datatype])
    where = f"inputs[{index}].data"
    if isinstance(tensor.data, str):
        try:
            raw = base64.b64decode(tensor.data, validate=True)
        except ValueError:  # binascii.Error, or characters beyond ASCII
            raise RequestError(f"{where} is a string but not base64", param=where) from None
        return Tensor(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape, data=raw)
    try:
        values = np.asarray(tensor.data)
    except ValueError:
        raise RequestError(f"{where} is not a regular (non-ragged) list", param=where) from None
    if values.size and values.dtype.kind not in _KINDS[dtype.kind]:
        raise RequestError(
            f"{where} must hold {tensor.datatype.value} values, not {values.dtype.kind!r}-kind "
            "values (strings, nulls, objects, or floats for an integer type)",
            param=where,
        )
    if dtype.kind in "iu" and values.size:
        info = np.iinfo(dtype)
        if values.min() < info.min or values.max() > info.max:
            raise RequestError(f"{where} has values outside {tensor.datatype.value}", param=where)
    data = values.astype(dtype).tobytes()
    return Tensor(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape, data=data)


@dataclass(slots=True)
class TensorPipeline:
    name: str
    card: ModelDeploymentCard
    caller: UnaryCaller[TensorRequest, TensorOutput]
    client: InstanceSource
    gate: WorkerGate | None = None

    @property
    def spec(self) -> TensorModelSpec:
        assert self.card.tensor is not None
        return self.card.tensor

    def check(self, request: TensorInferRequest) -> TensorRequest:
        """The request as the worker takes it; a 400 naming the field that does not fit."""
        inputs = [to_wire(t, i) for i, t in enumerate(request.inputs)]
        problem = tensor_problem(self.spec, inputs)
        if problem is not None:
            raise RequestError(problem[1], param=problem[0])
        declared = {t.name for t in self.spec.outputs}
        names = [o.name for o in request.outputs or []]
        for i, name in enumerate(names):
            if name not in declared:
                raise RequestError(
                    f"the model has no output {name!r} (outputs: {', '.join(sorted(declared))})",
                    param=f"outputs[{i}].name",
                )
            if name in names[:i]:
                raise RequestError(f"output {name!r} asked twice", param=f"outputs[{i}].name")
        return TensorRequest(inputs=inputs, outputs=names)

    async def infer(self, request: TensorInferRequest, ctx: RequestContext) -> TensorInferResponse:
        wire = self.check(request)
        if self.gate is not None:
            self.gate.check()
        reply = await self.caller.call(wire, ctx, apply_nvext(request.nvext, ctx))
        binary = {
            o.name for o in request.outputs or [] if o.parameters and o.parameters.binary_data
        }
        wanted = wire.outputs or [t.name for t in self.spec.outputs]
        got = {t.name: t for t in reply.outputs}
        outputs = []
        for name in wanted:
            tensor = got.get(name)
            if tensor is None:
                raise WorkerProtocolError(f"the worker's reply lacks output {name!r}")
            try:
                values = np.frombuffer(tensor.data, dtype=NUMPY_DTYPES[tensor.datatype])
                values = values.reshape(tensor.shape)
            except ValueError as exc:
                raise WorkerProtocolError(
                    f"output {name!r} does not match its shape: {exc}"
                ) from None
            data: list[Any] | str = (
                base64.b64encode(tensor.data).decode()
                if name in binary
                else values.reshape(-1).tolist()
            )
            outputs.append(
                OutputTensor(name=name, datatype=tensor.datatype, shape=tensor.shape, data=data)
            )
        return TensorInferResponse(model_name=request.model, outputs=outputs, id=request.id)


def tensor_surface() -> Surface:
    return unary_surface("tensor", ModelKind.TENSOR, _decoder, TensorPipeline.infer)
