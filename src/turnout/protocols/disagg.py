"""Disaggregated serving on the wire: what moves between the frontend, prefill workers and
decode workers when prompt processing and decoding run on separate worker pools.

The flow (the frontend's ``router.prefill_router``):

1. The frontend sends the prompt to a prefill worker with ``max_tokens`` 1 and
   ``PreprocessedRequest.disagg = DisaggParams(prefill=PrefillParams(...))``. The worker
   computes the prompt's KV, answers with the first token and a ``KvHandle`` on that output
   (``LLMEngineOutput.kv_handle``), and keeps the blocks until the decode side has them
   (reference-counted; freed on transfer, on ``release``, or when ``ttl_s`` passes).
2. The frontend sends the prompt plus that first token to a decode worker with
   ``disagg = DisaggParams(handle=...)``. The decode worker takes the KV of the handle's
   ``num_tokens`` leading tokens instead of computing it, then decodes.

How the blocks travel, per prefill worker (``RuntimeConfig.kv_transfer``):

* ``pull``: the decode worker calls the prefill instance's ``KV_TRANSFER_HANDLER`` with
  ``op="pull"``; the reply ends once the bytes are across, and the prefill side frees them.
* ``push``: when the prefill request names its decode instance (``PrefillParams.push_to``),
  the prefill worker sends the blocks there itself, ``op="push"`` to the decode instance's
  handler, right after the first token; the decode worker waits for them to arrive. Without
  ``push_to`` a push worker serves a pull like any other.

A decode worker that cannot get the KV of a handle (prefill instance gone, handle unknown or
expired, transfer timed out) ends the stream with ``ErrorKind.KV_TRANSFER_FAILED`` before any
token: handles are single-use, so the frontend re-runs the prefill (elsewhere) and retries.
"""

from __future__ import annotations

import enum

import msgspec

from turnout.protocols.model import EndpointId

#: The side handler (``ServingInstance.add_handler``) through which workers move KV blocks:
#: request ``KvTransferRequest`` (msgpack), response one ``KvTransferReply``.
KV_TRANSFER_HANDLER = "kv_transfer"


class KvTransferMode(enum.StrEnum):
    PULL = "pull"
    PUSH = "push"


class KvHandle(msgspec.Struct, frozen=True, kw_only=True):
    """Where the KV of a prompt's leading tokens waits for its decode worker."""

    #: Unique on its prefill instance (hex).
    handle_id: str
    #: The prefill instance holding the blocks, and its endpoint (for the pull call).
    endpoint: EndpointId
    instance_id: int
    #: Leading tokens of the decode request whose KV the handle holds (the prompt).
    num_tokens: int
    #: Bytes the transfer moves (``num_tokens`` x the model's KV bytes per token).
    num_bytes: int
    mode: KvTransferMode = KvTransferMode.PULL
    #: Seconds the prefill side keeps the blocks after answering, at most.
    ttl_s: float = 30.0
    #: Push mode: the decode instance the blocks were sent to (None: waiting for a pull).
    pushed_to: int | None = None


class PrefillParams(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """On a prefill-stage request: compute the prompt, answer with a handle, keep the KV."""

    #: Push mode: the decode instance (of ``push_endpoint``) that will take the request.
    push_to: int | None = None
    push_endpoint: EndpointId | None = None


class DisaggParams(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """``PreprocessedRequest.disagg``: which stage of a disaggregated request this is."""

    prefill: PrefillParams | None = None
    handle: KvHandle | None = None


class KvTransferOp(enum.StrEnum):
    #: Decode side to prefill side: send me the blocks of ``handle_id``.
    PULL = "pull"
    #: Prefill side to decode side: here are the blocks of ``handle`` (bytes already across).
    PUSH = "push"
    #: Frontend to prefill side: nobody will take ``handle_id`` (cancelled, or the first token
    #: ended the request): free its blocks now.
    RELEASE = "release"


class KvTransferRequest(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    op: KvTransferOp
    handle_id: str
    #: With ``push``: the handle the blocks belong to.
    handle: KvHandle | None = None


class KvTransferReply(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    ok: bool
    num_bytes: int = 0
    #: Why not (``ok`` false): e.g. "unknown or expired handle 3fa2".
    error: str | None = None
