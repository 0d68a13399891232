"""The engine contract: what a worker runs behind its ``generate`` endpoint.

Two kinds of engine share one lifecycle (``EngineBase``: start, stop, card, failure):

* ``Engine`` (LLMs) turns one ``PreprocessedRequest`` into a stream of ``LLMEngineOutput``
  deltas, as described below.
* ``UnaryEngine`` (embedding and tensor models) answers one request with one reply
  (``protocols.unary``); it raises ``UnaryFailure`` to answer with an error instead.

LLM engines:

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
  ``finish_reason=ERROR`` and ``error`` set, never a hang; ``error_kind`` says what the
  frontend should do (``protocols.llm.ErrorKind``: ``bad_request`` -> 400, ``overloaded``
  -> 503, ``engine_failed`` -> migrate elsewhere).
* An engine that breaks for good (its loop died, its native library failed) calls
  ``report_failure``: the worker takes the instance out of discovery at once, fails the
  in-flight streams as ``engine_failed`` (they migrate) and the process exits non-zero.
  ``health()`` is probed periodically by the worker; a reason it returns has the same effect.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar, Generic, TypeVar

from turnout.protocols.llm import ErrorKind, LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import ModelDeploymentCard
from turnout.protocols.unary import UnaryReply
from turnout.runtime.context import RequestContext


class EngineBase(abc.ABC):
    """One model replica (or, for the mocker, one simulated worker): what every engine
    shares, whatever its requests."""

    #: Set by the worker (``on_failure``): called once with the reason the engine broke.
    _failure_handler: Callable[[str], None] | None = None
    #: Why the engine broke, once it did.
    failure: str | None = None

    def on_failure(self, handler: Callable[[str], None]) -> None:
        """Call ``handler(reason)`` when the engine breaks for good (see the module doc)."""
        self._failure_handler = handler
        if self.failure is not None:
            handler(self.failure)

    def report_failure(self, reason: str) -> None:
        """Say the engine broke for good (first call only); engines call this from their
        loop's failure path."""
        if self.failure is not None:
            return
        self.failure = reason
        if self._failure_handler is not None:
            self._failure_handler(reason)

    def health(self) -> str | None:
        """A cheap, synchronous liveness probe: None when healthy, else why not (e.g. the
        step loop has not stepped for too long while it had work). Called by the worker
        every few seconds; must not block."""
        return self.failure

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


class Engine(EngineBase):
    """An LLM engine: a stream of token deltas per request (see the module doc)."""

    @abc.abstractmethod
    def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]: ...


class UnaryFailure(Exception):
    """A unary engine's refusal or failure; the worker replies with ``error`` / ``error_kind``
    (``ErrorKind``: ``BAD_REQUEST`` 400, ``OVERLOADED`` 503, ``ENGINE_FAILED`` retried
    elsewhere)."""

    def __init__(self, message: str, kind: ErrorKind) -> None:
        super().__init__(message)
        self.kind = kind


Req = TypeVar("Req")
Reply = TypeVar("Reply", bound=UnaryReply)


class UnaryEngine(EngineBase, Generic[Req, Reply]):
    """An engine that answers each request with one reply (embeddings, tensors)."""

    #: The msgpack types of its requests and replies (the worker decodes and encodes them).
    request_type: ClassVar[type[Any]]
    reply_type: ClassVar[type[UnaryReply]]

    @abc.abstractmethod
    async def run(self, request: Req, ctx: RequestContext) -> Reply:
        """The reply to ``request``; raises ``UnaryFailure`` to refuse it. Cancelling the
        call (client gone) must drop the work if it has not started."""
