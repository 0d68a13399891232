"""The exception hierarchy of turnout.

::

    TurnoutError
    ├── ConfigError                 bad flag, bad combination; raised at start-up
    ├── DiscoveryError              the discovery store failed
    │   └── LeaseLost               a lease expired or was revoked under us
    ├── RequestPlaneError           sending to / streaming from a worker failed
    │   ├── PeerUnavailable         could not reach the instance (nothing was sent): retry elsewhere
    │   ├── StreamBroken            the peer went away mid-stream: migrate
    │   ├── RemoteError             the worker's handler raised; carries its message
    │   └── WorkerProtocolError     the worker's answer is not the protocol (HTTP 502)
    ├── RequestError                the request itself is wrong (HTTP 400)
    │   ├── ContextLengthExceeded   prompt does not fit the model's context
    │   └── EngineBadRequest        the engine refused the request as invalid
    ├── ModelNotFound               no such model (HTTP 404)
    ├── InstanceNotFound            the instance a request pins does not exist (HTTP 404)
    ├── FrontendOverloaded          admission limits reached (HTTP 429/503/529, Retry-After)
    ├── NoInstanceAvailable         the model has no live, not-busy instance (HTTP 503)
    │   └── EngineOverloaded        the worker's engine queue is full (HTTP 503, Retry-After)
    ├── RequestTimedOut             the request's deadline passed (HTTP 504)
    ├── TemplateLimitExceeded       the model's chat template passed its bounds (HTTP 500)
    ├── ResponseStoreError          the Responses API's store failed or is unreachable (HTTP 503)
    └── NotYetSupported             a named feature that is not implemented yet

Lower-layer exceptions are translated at the layer boundary into the most specific type here,
with the cause chained.
"""

from __future__ import annotations


class TurnoutError(Exception):
    """Base of every error turnout raises on purpose."""


class ConfigError(TurnoutError):
    pass


class DiscoveryError(TurnoutError):
    pass


class LeaseLost(DiscoveryError):
    pass


class RequestPlaneError(TurnoutError):
    pass


class PeerUnavailable(RequestPlaneError):
    """Nothing reached the peer; the request may safely go to another instance."""


class StreamBroken(RequestPlaneError):
    """The peer vanished after the stream started; the request may be migrated."""


class RemoteError(RequestPlaneError):
    """The remote handler failed and said why."""


class RequestError(TurnoutError):
    """The client's request is invalid (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(RequestError):
    pass


class ModelNotFound(TurnoutError):
    pass


class NoInstanceAvailable(TurnoutError):
    pass


class NotYetSupported(TurnoutError):
    pass


class EngineBadRequest(RequestError):
    """The worker's engine refused the request as one it can never run (HTTP 400)."""


class EngineOverloaded(NoInstanceAvailable):
    """The worker's engine queue is full; the client should retry later (HTTP 503)."""


class RequestTimedOut(TurnoutError):
    """The request's deadline (``--request-timeout``, ``nvext.request_timeout``) passed; its
    work was cancelled (HTTP 504)."""


class TemplateLimitExceeded(TurnoutError):
    """The model's chat template ran past its operation, size or time budget
    (``llm.template_sandbox``): the model's fault, never the client's (HTTP 500). A card
    whose template does so on a probe conversation is refused when it is loaded."""


class ResponseStoreError(TurnoutError):
    """The response store could not be reached or failed a call (the frontend answers 503)."""


class WorkerProtocolError(RequestPlaneError):
    """A worker answered with something that is not the protocol (an undecodable or
    ill-typed output): the worker's or the deployment's fault, never the client's (HTTP
    502). Not migrated: another worker of the same build would likely answer the same."""


class InstanceNotFound(TurnoutError):
    """The instance a request pins (``nvext.backend_instance_id``) is not one discovery
    knows: retrying cannot help (HTTP 404). A known instance that is down stays
    ``NoInstanceAvailable`` (503)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class FrontendOverloaded(TurnoutError):
    """The frontend's admission limits turned the request away (``--max-inflight``,
    ``--max-inflight-per-model``, ``--queue-size``, ``--queue-timeout``). ``reason`` is a
    bounded label (``queue_full``, ``queue_timeout``, ``model_limit``); ``waited`` the
    seconds it spent queued. HTTP ``--reject-status`` (429, 503 or 529) with ``Retry-After``."""

    def __init__(self, message: str, *, reason: str, waited: float = 0.0) -> None:
        super().__init__(message)
        self.reason = reason
        self.waited = waited
