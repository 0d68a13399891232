"""OpenAI's chat fields that ask nothing of generation (``store``, ``metadata``,
``modalities``, ``service_tier``, ``safety_identifier``), and their bounds.

Each is honoured as what it means in turnout or refused with a 400 naming it. The checks read
no card and no tokenizer, so they live apart from the ``Preprocessor`` (which runs them on
every chat request); the stored responses of the Responses API (``frontend.responses.history``)
hold their ``metadata`` to the same bounds.
"""

from __future__ import annotations

from turnout.errors import RequestError
from turnout.protocols.openai import ChatCompletionRequest

#: OpenAI's bounds on ``metadata``: pairs, a key's and a value's characters.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: Longest end-user id (``safety_identifier``) accepted: an id or a hash, not a document.
MAX_USER_ID_CHARS = 256
#: The service tiers a request may name: turnout serves one, which answers as ``default``.
SERVICE_TIERS = ("auto", "default")


def check_openai_fields(req: ChatCompletionRequest) -> None:
    """OpenAI's chat fields that ask nothing of generation, each honoured as what it means
    here, or refused with a 400 naming it:

    * ``store``: OpenAI keeps a stored completion (``GET /v1/chat/completions/{id}``) when
      true; turnout keeps none, so ``false`` is honoured and ``true`` refused.
    * ``metadata``: tags of a stored completion (OpenAI returns them only there, never in
      the completion); checked to OpenAI's bounds, and with nothing stored, kept nowhere.
    * ``modalities``: ``["text"]`` is what every model here writes; audio is refused.
    * ``service_tier``: ``auto`` or ``default``, answered as ``default`` in the response's
      ``service_tier`` (turnout serves one tier); ``flex``, ``scale``, ``priority`` refused.
    * ``safety_identifier`` (as ``user``): the end user's id for a provider's abuse
      monitoring; turnout runs none, so it is checked and changes nothing.
    * ``prompt_cache_key``: the routing session key (the HTTP service reads it).
    """
    if req.store:
        raise RequestError(
            "turnout does not store chat completions (there is no GET "
            "/v1/chat/completions/{id} to read them back); send 'store': false or leave it out",
            param="store",
        )
    metadata = req.metadata
    if metadata is not None:
        if len(metadata) > MAX_METADATA_PAIRS:
            raise RequestError(
                f"'metadata' has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS}",
                param="metadata",
            )
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise RequestError(
                    f"'metadata' keys are at most {MAX_METADATA_KEY_CHARS} characters and "
                    f"values at most {MAX_METADATA_VALUE_CHARS}",
                    param="metadata",
                )
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise RequestError(
            f"model '{req.model}' writes text only: 'modalities' must be [\"text\"]",
            param="modalities",
        )
    if req.service_tier is not None and req.service_tier not in SERVICE_TIERS:
        raise RequestError(
            f"'service_tier' {req.service_tier!r} is not served: turnout has one tier "
            "('auto' or 'default' name it)",
            param="service_tier",
        )
    safety = req.safety_identifier
    if safety is not None and len(safety) > MAX_USER_ID_CHARS:
        raise RequestError(
            f"'safety_identifier' is longer than {MAX_USER_ID_CHARS} characters",
            param="safety_identifier",
        )


__all__ = [
    "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_PAIRS",
    "MAX_METADATA_VALUE_CHARS",
    "MAX_USER_ID_CHARS",
    "SERVICE_TIERS",
    "check_openai_fields",
]
