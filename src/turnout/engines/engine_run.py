"""One request's engine stream, stepped in the handler's own task, in batches of what is ready.

Mental model: the worker's generate handler wants each output as soon as the engine has it,
and, when the engine ran ahead (a burst of speculative tokens, outputs an engine thread queued
while the handler waited on the request plane's credit), everything it has in one go, merged
into one item. Running the engine in a task of its own behind a buffer gives that, at the
price of a task per request and, per token, a future and an extra event-loop turn to hand the
output over.

``EngineRun`` gets the same without them. It steps the engine's iterator by hand: each step
is the awaitable of ``__anext__``, sent ``None`` as a task would. A step that finishes at
once is an output that was ready; a step that has to wait yields the future it waits on, and
then what was collected goes out as one batch, after which the handler's task waits on that
very future (``_Resume`` passes it up, as ``await`` would), so the engine resumes in the
handler's task with no hop of its own::

    step ──send──▶ output ready ──▶ collect ─┐
      ▲                                      │ (up to MAX_BATCH)
      └──────────────────────────────────────┘
    step ──send──▶ waits on F ──▶ yield the batch ──▶ task awaits F ──▶ step resumes

Cancellation keeps a task's semantics: the handler's task cancelled while it waits on the
engine throws ``CancelledError`` into the engine where it waits; a step left mid-way (the
handler closed while a batch was out) is stopped the same way and run to its end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any

from turnout.protocols.llm import LLMEngineOutput

#: Outputs collected into one batch at most: an engine that never waits is paused there
#: (back-pressure: the request plane's credit window stops the handler, and so the engine).
MAX_BATCH = 64

#: A step of an engine's iterator: the generator behind ``await anext(engine)``.
Step = Generator[Any, None, LLMEngineOutput]


class EngineRun:
    """The outputs of one engine stream, in batches (see the module docstring).

    ``final`` is set once, by ``fail``; ``_step`` is the step in flight, ``_waiting`` the
    future it waits on while the handler's task is parked on it (both changed only by
    ``batches`` and ``_Resume``, in the handler's task).
    """

    __slots__ = ("_render", "_runs", "_source", "_step", "_waiting", "final")

    def __init__(
        self,
        source: AsyncIterator[LLMEngineOutput],
        render: Callable[[list[LLMEngineOutput]], list[bytes]],
        runs: set[EngineRun],
    ) -> None:
        """``render``: a batch of outputs as the items to send; ``runs``: the set this run is
        in while its items are being iterated (whoever may have to ``fail`` it)."""
        self._source = source
        self._render = render
        self._runs = runs
        self._step: Step | None = None
        self._waiting: Any = None
        #: The output that ends the stream early (``fail``), after what was collected.
        self.final: LLMEngineOutput | None = None

    def fail(self, final: LLMEngineOutput) -> None:
        """End the stream with ``final`` after what was collected, and stop the engine (it
        sees ``CancelledError`` where it waits), even if it would never produce again."""
        if self.final is not None:
            return
        self.final = final
        waiting = self._waiting
        if isinstance(waiting, asyncio.Future):
            waiting.cancel()  # what cancelling a task parked on it does

    async def items(self) -> AsyncIterator[bytes]:
        """The rendered items of each batch of outputs that were ready together, in order;
        ``final``'s last if set. An engine's exception is raised after the outputs that
        preceded it."""
        source = self._source
        render = self._render
        ready: list[LLMEngineOutput] = []
        self._runs.add(self)
        try:
            while self.final is None:
                step = self._step = source.__anext__().__await__()
                try:
                    waits_on = step.send(None)
                except StopIteration as stop:
                    self._step = None
                    ready.append(stop.value)
                    if len(ready) >= MAX_BATCH:
                        for item in render(ready):
                            yield item
                        ready = []
                    continue
                except StopAsyncIteration:
                    self._step = None
                    break
                except Exception:
                    self._step = None
                    if ready:
                        for item in render(ready):
                            yield item
                    raise
                if ready:  # the engine must wait: what it gave so far goes out first
                    for item in render(ready):
                        yield item
                    ready = []
                    if self.final is not None:
                        break
                try:
                    output = await _Resume(self, step, waits_on)
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if self.final is None or (task is not None and task.cancelling()):
                        raise
                    break  # ``fail`` stopped the engine
                finally:
                    self._step = None
                ready.append(output)
            if self._step is not None:
                await self._stop_step()
            if ready:
                for item in render(ready):
                    yield item
            if self.final is not None:
                for item in render([self.final]):
                    yield item
        finally:
            self._runs.discard(self)
            if self._step is not None:
                await self._stop_step()
            await source.aclose()  # type: ignore[attr-defined]

    async def _stop_step(self) -> None:
        """Stop the step in flight as a task would be cancelled, and run it to its end (the
        engine may wait while it cleans up). A cancel of the handler's own task meanwhile
        is raised."""
        step = self._step
        assert step is not None
        self._step = None
        try:
            waits_on = step.throw(asyncio.CancelledError())
        except (StopIteration, StopAsyncIteration, asyncio.CancelledError):
            return
        try:
            await _Resume(self, step, waits_on, stopping=True)
        except (StopAsyncIteration, asyncio.CancelledError):
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise


class _Resume(Awaitable[LLMEngineOutput]):
    """Awaits the rest of a step that yielded ``waits_on``: what ``await`` does with an
    awaitable (``yield from``), from its second yield on, except that once the run failed
    (``final`` set) the step is resumed with ``CancelledError`` (once), as a cancelled task
    would be: an engine that only ever yields bare (``sleep(0)``) is stopped too.
    ``stopping``: the step was stopped already."""

    __slots__ = ("_run", "_step", "_stopping", "_waits_on")

    def __init__(self, run: EngineRun, step: Step, waits_on: Any, stopping: bool = False) -> None:
        self._run = run
        self._step = step
        self._waits_on = waits_on
        self._stopping = stopping

    def __await__(self) -> Generator[Any, None, LLMEngineOutput]:
        run, step, waits_on = self._run, self._step, self._waits_on
        while True:
            run._waiting = waits_on
            try:
                yield waits_on
            except GeneratorExit:
                run._waiting = None
                step.close()
                raise
            except BaseException as exc:
                run._waiting = None
                self._stopping = self._stopping or run.final is not None
                try:
                    waits_on = step.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                run._waiting = None
                try:
                    if run.final is not None and not self._stopping:
                        self._stopping = True
                        waits_on = step.throw(asyncio.CancelledError())
                    else:
                        waits_on = step.send(None)
                except StopIteration as stop:
                    return stop.value
