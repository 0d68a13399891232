"""A BERT sentence-embedding model as an ONNX graph, built from its safetensors weights.

Sentence-transformers models such as all-MiniLM-L6-v2 ship as PyTorch weights
(``model.safetensors``) with a BERT ``config.json`` and a pooling config. Running them the
reference way needs PyTorch; turnout instead writes the same computation as an ONNX graph
(embeddings, ``num_hidden_layers`` encoder layers, masked mean or CLS pooling, optional L2
normalisation) and runs it with ONNX Runtime, which batches and multithreads it well on a
CPU. The graph follows Hugging Face's ``BertModel`` (post-layer-norm, exact GELU, absolute
positions, token type 0) and sentence-transformers' ``Pooling`` and ``Normalize`` modules;
its answers agree with theirs to float32 rounding (the tests compare with vectors
sentence-transformers produced).

Inputs: ``input_ids`` and ``attention_mask``, int64 ``[batch, sequence]``. Output:
``sentence_embedding``, float32 ``[batch, hidden_size]``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

#: ONNX opset of the graph (17: ``LayerNormalization`` is a standard op).
OPSET = 17

_SAFETENSORS_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
}


def read_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """Every tensor of a ``.safetensors`` file's bytes (bf16 is widened to float32)."""
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    base = 8 + header_len
    tensors: dict[str, np.ndarray] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        raw = data[base + start : base + end]
        dtype = meta["dtype"]
        if dtype == "BF16":
            wide = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            array = wide.view(np.float32)
        elif dtype in _SAFETENSORS_DTYPES:
            array = np.frombuffer(raw, dtype=_SAFETENSORS_DTYPES[dtype])
        else:
            raise ValueError(f"tensor {name} has unsupported dtype {dtype}")
        tensors[name] = array.reshape(meta["shape"]).copy()
    return tensors


@dataclass(frozen=True, slots=True)
class BertShape:
    """The parts of a BERT ``config.json`` the graph depends on."""

    hidden_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    max_positions: int

    @classmethod
    def from_config(cls, config: dict[str, object]) -> BertShape:
        if config.get("model_type") != "bert":
            raise ValueError(f"not a BERT model (model_type={config.get('model_type')!r})")
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r}")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        return cls(
            hidden_size=int(config["hidden_size"]),  # type: ignore[call-overload]
            num_layers=int(config["num_hidden_layers"]),  # type: ignore[call-overload]
            num_heads=int(config["num_attention_heads"]),  # type: ignore[call-overload]
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),  # type: ignore[arg-type]
            max_positions=int(config["max_position_embeddings"]),  # type: ignore[call-overload]
        )


def build_bert_embedding_graph(
    weights: dict[str, np.ndarray],
    shape: BertShape,
    *,
    pooling: str = "mean",
    normalize: bool = True,
) -> bytes:
    """The serialized ONNX model (see the module doc). ``pooling``: ``mean`` or ``cls``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if pooling not in ("mean", "cls"):
        raise ValueError(f"unsupported pooling {pooling!r} (mean or cls)")
    prefix = "bert." if "bert.embeddings.word_embeddings.weight" in weights else ""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    counter = 0

    def w(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def p(name: str) -> np.ndarray:
        key = prefix + name
        if key not in weights:
            raise ValueError(f"weights lack tensor {key!r}")
        return weights[key].astype(np.float32)

    def op(kind: str, *inputs: str, **attrs: Any) -> str:
        nonlocal counter
        counter += 1
        out = f"{kind.lower()}_{counter}"
        nodes.append(helper.make_node(kind, list(inputs), [out], **attrs))
        return out

    def const(name: str, values: list[int] | list[float], dtype: type = np.int64) -> str:
        return w(name, np.array(values, dtype=dtype))

    def linear(x: str, name: str) -> str:
        weight = w(f"{name}.weight_t", p(f"{name}.weight").T)
        bias = w(f"{name}.bias", p(f"{name}.bias"))
        return op("Add", op("MatMul", x, weight), bias)

    def layer_norm(x: str, name: str) -> str:
        scale = w(f"{name}.weight", p(f"{name}.weight"))
        bias = w(f"{name}.bias", p(f"{name}.bias"))
        return op("LayerNormalization", x, scale, bias, axis=-1, epsilon=shape.layer_norm_eps)

    hidden, heads = shape.hidden_size, shape.num_heads
    head_dim = hidden // heads
    # Embeddings: word + position (0..S-1) + token type 0, then LayerNorm.
    words = op("Gather", w("word_embeddings", p("embeddings.word_embeddings.weight")), "input_ids")
    seq_len = op("Gather", op("Shape", "input_ids"), const("axis1", [1]))
    positions = op(
        "Slice",
        w("position_embeddings", p("embeddings.position_embeddings.weight")),
        const("zero", [0]),
        seq_len,
        const("axis0", [0]),
    )
    token_type = w("token_type_0", p("embeddings.token_type_embeddings.weight")[0])
    x = layer_norm(op("Add", op("Add", words, positions), token_type), "embeddings.LayerNorm")
    # Attention bias: 0 where attended, a large negative number at padding: [B, 1, 1, S].
    mask = op("Cast", "attention_mask", to=TensorProto.FLOAT)
    bias = op(
        "Mul",
        op("Sub", const("one", [1.0], np.float32), mask),
        const("neg", [float(np.finfo(np.float32).min)], np.float32),
    )
    bias = op("Unsqueeze", bias, const("axes12", [1, 2]))
    split_heads = const("split_heads", [0, -1, heads, head_dim])
    merge_heads = const("merge_heads", [0, -1, hidden])
    scale = const("scale", [1.0 / float(np.sqrt(head_dim))], np.float32)
    for i in range(shape.num_layers):
        base = f"encoder.layer.{i}"

        def heads_of(name: str, x: str = x, base: str = base) -> str:
            projected = linear(x, f"{base}.attention.self.{name}")
            return op("Transpose", op("Reshape", projected, split_heads), perm=[0, 2, 1, 3])

        q, k, v = heads_of("query"), heads_of("key"), heads_of("value")
        scores = op("Mul", op("MatMul", q, op("Transpose", k, perm=[0, 1, 3, 2])), scale)
        probs = op("Softmax", op("Add", scores, bias), axis=-1)
        context = op("Transpose", op("MatMul", probs, v), perm=[0, 2, 1, 3])
        attended = linear(op("Reshape", context, merge_heads), f"{base}.attention.output.dense")
        x = layer_norm(op("Add", attended, x), f"{base}.attention.output.LayerNorm")
        inner = linear(x, f"{base}.intermediate.dense")
        # Exact GELU: 0.5 * x * (1 + erf(x / sqrt(2))).
        erf = op("Erf", op("Div", inner, const(f"sqrt2_{i}", [float(np.sqrt(2.0))], np.float32)))
        gelu = op(
            "Mul",
            op("Mul", inner, op("Add", erf, const(f"one_{i}", [1.0], np.float32))),
            const(f"half_{i}", [0.5], np.float32),
        )
        out = linear(gelu, f"{base}.output.dense")
        x = layer_norm(op("Add", out, x), f"{base}.output.LayerNorm")
    if pooling == "mean":
        weights_3d = op("Unsqueeze", mask, const("axis2", [2]))
        summed = op("ReduceSum", op("Mul", x, weights_3d), const("axis1b", [1]), keepdims=0)
        counts = op("ReduceSum", weights_3d, const("axis1c", [1]), keepdims=0)
        counts = op("Max", counts, const("tiny", [1e-9], np.float32))
        pooled = op("Div", summed, counts)
    else:
        pooled = op("Squeeze", op("Gather", x, const("first", [0]), axis=1), const("axis1d", [1]))
    if normalize:
        norm = op("ReduceL2", pooled, axes=[-1], keepdims=1)  # axes: an attribute until opset 18
        pooled = op("Div", pooled, op("Max", norm, const("eps_norm", [1e-12], np.float32)))
    nodes.append(helper.make_node("Identity", [pooled], ["sentence_embedding"]))
    graph = helper.make_graph(
        nodes,
        "bert_sentence_embedding",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info(
                "attention_mask", TensorProto.INT64, ["batch", "sequence"]
            ),
        ],
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", hidden])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="turnout"
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()
