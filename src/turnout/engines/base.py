"""The engine contract: what a worker runs behind its ``generate`` endpoint.

An engine turns one ``PreprocessedRequest`` into a stream of ``LLMEngineOutput`` deltas.

Contract:

* Each output carries only the new token ids; the last one has ``finish_reason`` set (and,
  where the engine knows it, ``usage`` with ``prompt_tokens``, ``completion_tokens`` and
  ``cached_tokens``).
* The engine honours ``stop_conditions.max_tokens`` and stops at ``eos_token_ids`` /
  ``stop_token_ids_hidden`` unless ``ignore_eos``; the frontend's backend enforces them too.
* ``ctx.cancel()`` (client gone) must stop the work promptly: the generator is also closed
  (``aclose()``), which raises ``GeneratorExit``/``CancelledError`` inside it; clean up and
  let it propagate.
* Bad requests (e.g. a prompt longer than the engine can hold) end the stream with
  ``finish_reason=ERROR`` and ``error`` set, never a hang.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator

from turnout.protocols.llm import LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import ModelDeploymentCard
from turnout.runtime.context import RequestContext


class Engine(abc.ABC):
    """One model replica (or, for the mocker, one simulated worker)."""

    @abc.abstractmethod
    def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]: ...

    async def start(self) -> None:
        """Load weights, start background loops. Called once before ``generate``."""

    async def stop(self) -> None:
        """Release resources; in-flight streams end."""

    def bind_instance(self, instance_id: int) -> None:
        """Told the instance id once discovery assigned it (engines that publish events use it
        as their worker id)."""

    @abc.abstractmethod
    def model_card_template(self) -> ModelDeploymentCard:
        """The card to publish, with ``endpoint`` and ``instance_id`` left for the worker to set.

        Tokenizer, chat template, context length, block size and runtime config come from
        the engine, which knows its model.
        """
