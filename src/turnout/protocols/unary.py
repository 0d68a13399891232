"""Request-plane messages of models that answer a request with one reply: embeddings and
tensor models (``ModelInput.Tokens`` + ``Embedding``, ``ModelInput.Tensor`` + ``TensorBased``).

A frontend sends one msgpack request; the worker streams back exactly one msgpack reply.
Every reply carries ``error`` / ``error_kind`` (the kinds of ``protocols.llm.ErrorKind``:
``engine_failed`` makes the frontend retry on another instance, ``bad_request`` is a 400,
``overloaded`` a 503); a reply with an error has no result.

Numbers travel as raw little-endian bytes, not lists: a batch of 32 embeddings of 384
dimensions is 48 KiB of float32, which msgpack copies once instead of encoding 12,288 floats.

Requests forbid unknown fields (a worker refuses a field it does not know rather than drop
it); replies and ``Tensor``, which replies carry too, tolerate them.
"""

from __future__ import annotations

import enum

import msgspec


class UnaryReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What every reply has: why it failed, if it did."""

    error: str | None = None
    error_kind: str | None = None


# -- embeddings --------------------------------------------------------------------------------


class EmbeddingSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What an embedding model's card says about its vectors."""

    #: Length of each vector.
    dimensions: int
    #: Vectors have unit length (cosine similarity is their dot product).
    normalized: bool = False
    #: Shorter lengths the vectors may be cut to and stay meaningful (Matryoshka training);
    #: a client's ``dimensions`` must be one of these or ``dimensions`` itself.
    truncatable_to: list[int] = msgspec.field(default_factory=list)


class EmbeddingRequest(
    msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """Embed each token sequence (one client request: one or more inputs)."""

    token_ids: list[list[int]]


class EmbeddingOutput(UnaryReply, kw_only=True, omit_defaults=True):
    """The vectors of a request, in its order: ``count`` x ``dimensions`` float32, row-major."""

    embeddings: bytes = b""
    count: int = 0
    dimensions: int = 0
    #: Tokens the model read (the sum of the inputs' lengths).
    prompt_tokens: int = 0


# -- tensors -----------------------------------------------------------------------------------


class DataType(enum.StrEnum):
    """KServe v2's numeric datatypes (``BYTES`` is not served)."""

    BOOL = "BOOL"
    UINT8 = "UINT8"
    UINT16 = "UINT16"
    UINT32 = "UINT32"
    UINT64 = "UINT64"
    INT8 = "INT8"
    INT16 = "INT16"
    INT32 = "INT32"
    INT64 = "INT64"
    FP16 = "FP16"
    FP32 = "FP32"
    FP64 = "FP64"


#: numpy's dtype string of each datatype (little-endian on the wire).
NUMPY_DTYPES: dict[DataType, str] = {
    DataType.BOOL: "|b1",
    DataType.UINT8: "|u1",
    DataType.UINT16: "<u2",
    DataType.UINT32: "<u4",
    DataType.UINT64: "<u8",
    DataType.INT8: "|i1",
    DataType.INT16: "<i2",
    DataType.INT32: "<i4",
    DataType.INT64: "<i8",
    DataType.FP16: "<f2",
    DataType.FP32: "<f4",
    DataType.FP64: "<f8",
}


class TensorSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One named input or output of a tensor model. ``-1`` in ``shape``: any length."""

    name: str
    datatype: DataType
    shape: list[int]


class TensorModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a tensor model's card declares: the frontend checks requests against it."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


class Tensor(msgspec.Struct, kw_only=True):
    name: str
    datatype: DataType
    shape: list[int]
    #: The elements, row-major, little-endian (``NUMPY_DTYPES[datatype]``).
    data: bytes


class TensorRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    inputs: list[Tensor]
    #: Names of the outputs wanted (empty: all the model declares).
    outputs: list[str] = msgspec.field(default_factory=list)


class TensorOutput(UnaryReply, kw_only=True, omit_defaults=True):
    outputs: list[Tensor] = msgspec.field(default_factory=list)


def tensor_problem(spec: TensorModelSpec, inputs: list[Tensor]) -> tuple[str, str] | None:
    """Why ``inputs`` do not fit the model's declared inputs, as (the field at fault, the
    reason); None when they fit. Checked by the frontend (a 400 naming the field) and again
    by the worker (for requests that reach it another way)."""
    declared = {t.name: t for t in spec.inputs}
    seen: set[str] = set()
    for i, tensor in enumerate(inputs):
        where = f"inputs[{i}]"
        want = declared.get(tensor.name)
        if want is None:
            names = ", ".join(sorted(declared))
            return f"{where}.name", f"the model has no input {tensor.name!r} (inputs: {names})"
        if tensor.name in seen:
            return f"{where}.name", f"input {tensor.name!r} is given twice"
        seen.add(tensor.name)
        if tensor.datatype != want.datatype:
            return (
                f"{where}.datatype",
                f"input {tensor.name!r} is {want.datatype.value}, not {tensor.datatype.value}",
            )
        if len(tensor.shape) != len(want.shape) or any(
            d != w and w != -1 for d, w in zip(tensor.shape, want.shape, strict=True)
        ):
            return (
                f"{where}.shape",
                f"input {tensor.name!r} has shape {tensor.shape}; the model takes "
                f"{want.shape} (-1: any length)",
            )
        if any(d < 0 for d in tensor.shape):
            return f"{where}.shape", f"input {tensor.name!r} has a negative dimension"
        count = 1
        for d in tensor.shape:
            count *= d
        itemsize = int(NUMPY_DTYPES[tensor.datatype][-1])
        if len(tensor.data) != count * itemsize:
            return (
                f"{where}.data",
                f"input {tensor.name!r} of shape {tensor.shape} needs {count} elements "
                f"({count * itemsize} bytes), got {len(tensor.data)} bytes",
            )
    missing = sorted(set(declared) - seen)
    if missing:
        return "inputs", f"missing input(s): {', '.join(missing)}"
    return None
