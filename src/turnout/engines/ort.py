"""ONNX Runtime sessions as turnout's engines run them on a CPU."""

from __future__ import annotations

from typing import Any


def cpu_session(graph: bytes | str, threads: int | None = None) -> Any:
    """An ``onnxruntime.InferenceSession`` of ``graph`` (bytes, or a file's path) on the CPU,
    with ``threads`` threads for one run (None: ONNX Runtime's default, one per core).

    Its threads do not spin between runs (ONNX Runtime's default is to spin): on a small
    machine, spinning threads take the cores the frontend and the request plane need
    between two batches (measured: 107 -> 173 single-sentence embedding requests/s with
    four clients on 2 cores, ``benchmarks/embeddings.py``)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
