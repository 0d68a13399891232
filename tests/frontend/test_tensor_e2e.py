"""``/v1/tensor`` end to end: a deterministic numeric engine and real ONNX models (a small
graph built here, and all-MiniLM-L6-v2's) behind workers; requests that do not fit the
card's tensors are 400s naming the field."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from tests.frontend.stack import Stack, make_stack

from turnout.engines.tensor import NumericEngine, OnnxTensorEngine
from turnout.protocols.model import EndpointId

REFERENCE = json.loads((Path(__file__).parents[1] / "data" / "minilm_reference.json").read_text())


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    s = await make_stack()
    await s.add_worker(NumericEngine(), model_name="numeric")
    await s.wait_for_model("numeric")
    yield s
    await s.close()


async def infer(stack: Stack, body: dict[str, object]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        return await http.post("/v1/tensor", json=body)


X = {"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [1, 5, 2, -1, -2, -3]}


async def test_numeric_outputs_as_lists(stack: Stack) -> None:
    r = await infer(stack, {"model": "numeric", "id": "r1", "inputs": [X]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_name"] == "numeric" and body["id"] == "r1"
    outputs = {o["name"]: o for o in body["outputs"]}
    assert outputs["affine"] == {
        "name": "affine",
        "datatype": "FP32",
        "shape": [2, 3],
        "data": [3, 11, 5, -1, -3, -5],
    }
    assert outputs["row_sum"]["data"] == [8.0, -6.0] and outputs["row_sum"]["datatype"] == "FP64"
    assert outputs["argmax"]["data"] == [1, 0] and outputs["argmax"]["shape"] == [2]
    assert [o["name"] for o in body["outputs"]] == ["affine", "row_sum", "argmax"]


async def test_base64_in_and_out_and_chosen_outputs(stack: Stack) -> None:
    x = np.arange(8, dtype="<f4").reshape(2, 4)
    body = {
        "model": "numeric",
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": base64.b64encode(x).decode()}
        ],
        "outputs": [{"name": "row_sum", "parameters": {"binary_data": True}}, {"name": "argmax"}],
    }
    r = await infer(stack, body)
    assert r.status_code == 200, r.text
    row_sum, argmax = r.json()["outputs"]
    assert row_sum["name"] == "row_sum"
    assert np.frombuffer(base64.b64decode(row_sum["data"]), "<f8").tolist() == [6.0, 22.0]
    assert argmax == {"name": "argmax", "datatype": "INT64", "shape": [2], "data": [3, 3]}


@pytest.mark.parametrize(
    ("inputs", "outputs", "param", "words"),
    [
        ([{**X, "shape": [6]}], None, "inputs[0].shape", "takes [-1, -1]"),
        ([{**X, "datatype": "FP64"}], None, "inputs[0].datatype", "is FP32, not FP64"),
        ([{**X, "datatype": "FP8"}], None, "inputs[0].datatype", ""),
        ([{**X, "shape": [2, 2]}], None, "inputs[0].data", "needs 4 elements"),
        ([{**X, "data": "not base64!"}], None, "inputs[0].data", "not base64"),
        ([{**X, "data": "ñoñó"}], None, "inputs[0].data", "not base64"),
        ([{**X, "data": base64.b64encode(b"12345").decode()}], None, "inputs[0].data", "bytes"),
        ([{**X, "data": ["a", "b", "c", "d", "e", "f"]}], None, "inputs[0].data", "FP32"),
        ([{**X, "data": [True] * 6}], None, "inputs[0].data", "FP32"),
        ([{**X, "data": [[1, 2, 3], [4, 5]]}], None, "inputs[0].data", "ragged"),
        ([{**X, "name": "y"}], None, "inputs[0].name", "no input 'y'"),
        ([X, X], None, "inputs[1].name", "given twice"),
        ([], None, "inputs", "missing input(s): x"),
        ([X], [{"name": "nope"}], "outputs[0].name", "no output 'nope'"),
        ([X], [{"name": "affine"}, {"name": "affine"}], "outputs[1].name", "twice"),
        ([{**X, "extra": 1}], None, "inputs[0].extra", "unrecognized"),
    ],
)
async def test_requests_that_do_not_fit_the_card_are_400s(
    stack: Stack, inputs: list[object], outputs: object, param: str, words: str
) -> None:
    body: dict[str, object] = {"model": "numeric", "inputs": inputs}
    if outputs is not None:
        body["outputs"] = outputs
    r = await infer(stack, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"]


async def test_tensor_models_serve_only_the_tensor_route(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        models = (await http.get("/v1/models")).json()["data"]
        assert [(m["id"], m["endpoints"]) for m in models] == [("numeric", ["/v1/tensor"])]
        r = await http.post(
            "/v1/chat/completions",
            json={"model": "numeric", "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 404 and "serves tensor requests" in r.json()["error"]["message"]
    r = await infer(stack, {"model": "nope", "inputs": [X]})
    assert r.status_code == 404


def small_onnx_model(path: Path) -> np.ndarray:
    """y = x @ w + 1 (FP32 [-1, 3] -> [-1, 2]) and twice = 2k (INT64 [-1] -> [-1])."""
    from onnx import TensorProto, helper, numpy_helper, save

    w = np.array([[1, 2], [3, 4], [5, 6]], dtype=np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["xw"]),
            helper.make_node("Add", ["xw", "one"], ["y"]),
            helper.make_node("Add", ["k", "k"], ["twice"]),
        ],
        "small",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
            helper.make_tensor_value_info("k", TensorProto.INT64, ["m"]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2]),
            helper.make_tensor_value_info("twice", TensorProto.INT64, ["m"]),
        ],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.ones(1, np.float32), "one")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    save(model, str(path))
    return w


async def test_an_onnx_model_declares_its_graph_and_runs(tmp_path: Path) -> None:
    w = small_onnx_model(tmp_path / "small.onnx")
    s = await make_stack()
    try:
        await s.add_worker(OnnxTensorEngine(tmp_path / "small.onnx"), model_name="small")
        await s.wait_for_model("small")
        card = s.frontend.manager.entries_for_model("small")[0]
        assert card.tensor is not None
        assert [(t.name, t.datatype.value, t.shape) for t in card.tensor.inputs] == [
            ("x", "FP32", [-1, 3]),
            ("k", "INT64", [-1]),
        ]
        x = [[1.0, 0.0, 2.0]]
        body = {
            "model": "small",
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": x},
                {"name": "k", "datatype": "INT64", "shape": [3], "data": [1, -2, 2**40]},
            ],
        }
        r = await infer(s, body)
        assert r.status_code == 200, r.text
        y, twice = r.json()["outputs"]
        assert y["data"] == (np.array(x, np.float32) @ w + 1).reshape(-1).tolist()
        assert twice["data"] == [2, -4, 2**41]
        for bad, words in [([1.5, 2, 3], "INT64"), ([1, 2, 2**70], "")]:
            k = {"name": "k", "datatype": "INT64", "shape": [3], "data": bad}
            r = await infer(s, {**body, "inputs": [body["inputs"][0], k]})  # type: ignore[index]
            assert r.status_code == 400 and r.json()["error"]["param"] == "inputs[1].data"
            assert words in r.json()["error"]["message"]
    finally:
        await s.close()


@pytest.mark.slow
async def test_the_default_onnx_model_is_minilm_and_agrees_with_the_reference() -> None:
    from tokenizers import Tokenizer

    from turnout.engines.embeddings.model import SentenceEmbeddingModel

    s = await make_stack()
    try:
        endpoint = EndpointId(namespace="test", component="onnx", name="generate")
        await s.add_worker(OnnxTensorEngine(threads=1), model_name="minilm", endpoint=endpoint)
        await s.wait_for_model("minilm")
        tokenizer = Tokenizer.from_str(SentenceEmbeddingModel(run=False).tokenizer_json.decode())
        ids = tokenizer.encode(REFERENCE["sentences"][0]).ids
        body = {
            "model": "minilm",
            "inputs": [
                {"name": "input_ids", "datatype": "INT64", "shape": [1, len(ids)], "data": ids},
                {"name": "attention_mask", "datatype": "INT64", "shape": [1, len(ids)],
                 "data": [1] * len(ids)},
            ],
        }  # fmt: skip
        r = await infer(s, body)
        assert r.status_code == 200, r.text
        (out,) = r.json()["outputs"]
        assert out["name"] == "sentence_embedding" and out["shape"] == [1, 384]
        got, want = np.array(out["data"]), np.array(REFERENCE["embeddings"][0])
        assert got @ want / np.linalg.norm(got) / np.linalg.norm(want) >= 0.999
    finally:
        await s.close()


async def test_a_deadline_passed_is_a_504(stack: Stack) -> None:
    r = await infer(stack, {"model": "numeric", "inputs": [X], "nvext": {"request_timeout": 1e-9}})
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "request_timeout"
