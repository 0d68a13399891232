"""The embeddings engine's batcher: batches form while one runs; bounds; cancellation."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from turnout.engines.base import UnaryFailure
from turnout.engines.embeddings.batcher import EmbeddingBatcher
from turnout.protocols.llm import ErrorKind


class Model:
    """``run``: each sequence's vector is [its first id, its length]; the first call blocks
    until ``release`` is set (so requests pile up behind it)."""

    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []
        self.release = threading.Event()
        self.fail_next = False
        self.started = threading.Event()

    def run(self, sequences: list[list[int]]) -> np.ndarray:
        self.started.set()
        if not self.calls:
            self.release.wait(10)
        self.calls.append(sequences)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("kernel error")
        return np.array([[s[0], len(s)] for s in sequences], dtype=np.float32)


async def until(cond: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.005)


async def test_requests_queued_behind_a_batch_run_as_one_batch() -> None:
    model = Model()
    batcher = EmbeddingBatcher(model.run, max_batch_size=8)
    batcher.start()
    first = asyncio.ensure_future(batcher.embed([[1]]))
    await until(model.started.is_set)  # the first batch runs
    rest = [asyncio.ensure_future(batcher.embed([[i + 2], [i + 2, 0]])) for i in range(3)]
    await asyncio.sleep(0.01)
    model.release.set()
    assert (await first).tolist() == [[1, 1]]
    results = await asyncio.gather(*rest)
    for i, vectors in enumerate(results):
        assert vectors.tolist() == [[i + 2, 1], [i + 2, 2]]
    assert [len(c) for c in model.calls] == [1, 6]
    assert batcher.stats.batches == 2 and batcher.stats.largest == 6
    await batcher.stop()


async def test_a_request_larger_than_a_batch_spans_several() -> None:
    model = Model()
    model.release.set()
    batcher = EmbeddingBatcher(model.run, max_batch_size=4, max_batch_tokens=100)
    batcher.start()
    vectors = await batcher.embed([[i] * (i + 1) for i in range(10)])
    assert vectors[:, 0].tolist() == list(range(10))
    assert [len(c) for c in model.calls] == [4, 4, 2]
    # The token budget caps padded tokens: 3 sequences of 40 tokens fit 100? No: 2 do.
    model.calls.clear()
    await batcher.embed([[7] * 40] * 3)
    assert [len(c) for c in model.calls] == [2, 1]
    await batcher.stop()


async def test_a_full_queue_refuses_as_overloaded_and_cancelled_requests_leave_it() -> None:
    model = Model()
    batcher = EmbeddingBatcher(model.run, max_waiting=2)
    batcher.start()
    running = asyncio.ensure_future(batcher.embed([[1]]))
    await until(model.started.is_set)
    waiting = [asyncio.ensure_future(batcher.embed([[2]])) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(UnaryFailure) as refused:
        await batcher.embed([[3]])
    assert refused.value.kind is ErrorKind.OVERLOADED
    waiting[0].cancel()
    await asyncio.sleep(0)
    assert len(batcher._queue) == 1
    model.release.set()
    await running
    assert (await waiting[1]).tolist() == [[2, 1]]
    assert [len(c) for c in model.calls] == [1, 1]  # the cancelled one never ran
    await batcher.stop()


async def test_a_failed_batch_fails_its_requests_only() -> None:
    model = Model()
    model.release.set()
    model.fail_next = True
    batcher = EmbeddingBatcher(model.run)
    batcher.start()
    with pytest.raises(UnaryFailure, match="kernel error") as failed:
        await batcher.embed([[1]])
    assert failed.value.kind is ErrorKind.ENGINE_FAILED
    assert (await batcher.embed([[5]])).tolist() == [[5, 1]]
    await batcher.stop()
    with pytest.raises(UnaryFailure, match="stopped"):
        await batcher.embed([[5]])
