"""Dynamic batching of embedding requests inside a worker.

Concurrent requests are cut into sequences and queued; one loop takes as many queued
sequences as a batch may hold (``max_batch_size`` sequences, ``max_batch_tokens`` padded
tokens) and runs them as one call in a worker thread, while new requests queue for the next
batch. No request waits for a batch to fill: a lone request runs at once, and under load
batches grow by themselves (the time one batch takes is the time the next one gathers). A
request larger than a batch runs over several. Order is first come, first served.

The queue is bounded (``max_waiting`` requests, each at most what the frontend lets one
request hold): past it a request is refused as ``overloaded`` (the frontend answers 503). A
request cancelled while queued leaves the queue without running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from turnout.engines.base import UnaryFailure
from turnout.protocols.llm import ErrorKind

log = logging.getLogger("turnout.engines.embeddings")


@dataclass(slots=True, eq=False)
class _Job:
    sequences: list[list[int]]
    future: asyncio.Future[np.ndarray]
    rows: list[np.ndarray | None] = field(default_factory=list)
    #: Sequences not yet handed to a batch.
    next: int = 0
    pending: int = 0


@dataclass(slots=True)
class BatchStats:
    """What the batcher did (for tests, logs and benchmarks)."""

    batches: int = 0
    sequences: int = 0
    largest: int = 0


class EmbeddingBatcher:
    """``await embed(sequences)``: their vectors, computed in batches with other requests'."""

    def __init__(
        self,
        run: Callable[[list[list[int]]], np.ndarray],
        *,
        max_batch_size: int = 32,
        max_batch_tokens: int = 16384,
        max_waiting: int = 1024,
    ) -> None:
        if max_batch_size < 1 or max_batch_tokens < 1 or max_waiting < 1:
            raise ValueError("batch limits must be at least 1")
        self._run = run
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_waiting = max_waiting
        self._queue: deque[_Job] = deque()
        self._wake = asyncio.Event()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="embeddings")
        self._task: asyncio.Task[None] | None = None
        self.stats = BatchStats()
        #: Why the loop stopped for good (None while it runs).
        self.failure: str | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="embed-batcher")
        self._task.add_done_callback(self._loop_ended)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_all("the engine stopped")
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            self.failure = self.failure or "stopped"
            return
        exc = task.exception()
        self.failure = f"batch loop died: {exc!r}"
        log.error("embedding %s", self.failure)
        self._fail_all(self.failure)

    def _fail_all(self, why: str) -> None:
        while self._queue:
            job = self._queue.popleft()
            if not job.future.done():
                job.future.set_exception(UnaryFailure(why, ErrorKind.ENGINE_FAILED))

    async def embed(self, sequences: list[list[int]]) -> np.ndarray:
        if self.failure is not None:
            raise UnaryFailure(f"engine failed: {self.failure}", ErrorKind.ENGINE_FAILED)
        if len(self._queue) >= self.max_waiting:
            raise UnaryFailure(
                f"{len(self._queue)} requests are waiting to be embedded (the limit)",
                ErrorKind.OVERLOADED,
            )
        job = _Job(sequences, asyncio.get_running_loop().create_future())
        job.rows = [None] * len(sequences)
        self._queue.append(job)
        self._wake.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            if job in self._queue:  # not (wholly) handed to a batch yet: leave the queue
                self._queue.remove(job)
            raise

    def _take(self) -> list[tuple[_Job, int]]:
        """The next batch: (job, sequence index) pairs, first come first served."""
        batch: list[tuple[_Job, int]] = []
        longest = 0
        while self._queue and len(batch) < self.max_batch_size:
            job = self._queue[0]
            length = len(job.sequences[job.next])
            longest_if = max(longest, length)
            if batch and longest_if * (len(batch) + 1) > self.max_batch_tokens:
                break
            longest = longest_if
            batch.append((job, job.next))
            job.next += 1
            job.pending += 1
            if job.next == len(job.sequences):
                self._queue.popleft()
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            batch = self._take()
            sequences = [job.sequences[i] for job, i in batch]
            try:
                vectors = await loop.run_in_executor(self._thread, self._run, sequences)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # One batch failed (not the process): its requests fail, the loop goes on.
                log.exception("embedding batch of %d inputs failed", len(batch))
                for job, _ in batch:
                    if not job.future.done():
                        job.future.set_exception(
                            UnaryFailure(f"embedding failed: {exc}", ErrorKind.ENGINE_FAILED)
                        )
                continue
            stats = self.stats
            stats.batches += 1
            stats.sequences += len(batch)
            stats.largest = max(stats.largest, len(batch))
            for (job, index), vector in zip(batch, vectors, strict=True):
                job.rows[index] = vector
                job.pending -= 1
                if job.pending == 0 and job.next == len(job.sequences) and not job.future.done():
                    job.future.set_result(np.stack(job.rows))  # type: ignore[arg-type]
