"""What workers write into the discovery store: instances and model deployment cards.

Key layout (a wire format; keep it stable)::

    v1/instances/{namespace}/{component}/{endpoint}/{instance_id:x}      -> Instance
    v1/mdc/{namespace}/{component}/{endpoint}/{instance_id:x}[/{lora}]    -> ModelDeploymentCard

Records written by a process carry its ``ProcessIdentity`` (host, pid, version, planes), so an
operator can tell who runs where, and a frontend can refuse a process on other planes.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Annotated

import msgspec

from turnout.protocols.unary import EmbeddingSpec, TensorModelSpec

INSTANCES_ROOT = "v1/instances"
MDC_ROOT = "v1/mdc"


class ModelType(enum.IntFlag):
    """What a model serves. A model may serve several (``Chat | Completions``)."""

    Chat = 1
    Completions = 2
    Embedding = 4
    TensorBased = 8
    Prefill = 16

    def supports_chat(self) -> bool:
        return bool(self & ModelType.Chat)

    def names(self) -> str:
        """``"Chat|Completions"``: readable in logs and error messages."""
        return "|".join(m.name for m in ModelType if m in self and m.name) or "none"


class WorkerRole(enum.StrEnum):
    """What part of a request an instance runs (``turnout worker --role``).

    ``aggregated`` runs whole requests. ``prefill`` computes prompts for decode workers and
    publishes a ``Prefill`` card (it serves no client request itself). ``decode`` runs whole
    requests too, and takes a prompt's KV from a prefill worker when the frontend has one.
    """

    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class ModelInput(enum.StrEnum):
    """What a worker's ``generate`` endpoint takes."""

    Tokens = "tokens"
    Text = "text"
    Tensor = "tensor"


class EndpointId(msgspec.Struct, frozen=True, kw_only=True):
    namespace: str
    component: str
    name: str

    def path(self) -> str:
        return f"{self.namespace}/{self.component}/{self.name}"

    @classmethod
    def parse(cls, text: str) -> EndpointId:
        """Parse ``namespace/component/endpoint`` (``dyn://`` prefix allowed)."""
        parts = text.removeprefix("dyn://").split("/")
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"endpoint must be 'namespace/component/endpoint', got {text!r}")
        return cls(namespace=parts[0], component=parts[1], name=parts[2])


class TransportAddress(msgspec.Struct, frozen=True, kw_only=True):
    """Where the request plane reaches an instance: ``kind`` names the plane."""

    kind: str
    address: str


class ProcessIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """Who wrote a record: the process, where it runs, and the planes it speaks.

    Every field has a default, so a record written by a process that predates a field still
    decodes (the field reads as unknown: empty, or 0 for ``pid``).
    """

    #: The host others reach the process at (its advertised host, else its hostname).
    host: str = ""
    pid: int = 0
    #: ``turnout.__version__`` of the process.
    version: str = ""
    #: Its request plane (``tcp``, ``nats``, ``local``) and event plane (``zmq``, ``nats``,
    #: ``local``).
    request_plane: str = ""
    event_plane: str = ""
    #: Where its Prometheus metrics are served (``http://host:port/metrics``; empty: none,
    #: e.g. a worker without ``--system-port``). A frontend's are on its HTTP address.
    metrics_url: str = ""

    def where(self) -> str:
        """``host:pid`` for log lines (``?`` for what the record does not say)."""
        return f"{self.host or '?'}:{self.pid or '?'}"

    def planes(self) -> str:
        """``request/event`` planes, ``?`` for one the record does not name."""
        return f"{self.request_plane or '?'}/{self.event_plane or '?'}"

    def runs_other_planes(self, request_plane: str, event_plane: str) -> bool:
        """True when the record names a request or event plane other than these. A plane it
        does not name (an older process) is not held against it."""
        return bool(self.request_plane and self.request_plane != request_plane) or bool(
            self.event_plane and self.event_plane != event_plane
        )


class Instance(ProcessIdentity, frozen=True, kw_only=True):
    """One served instance of an endpoint: where the request plane reaches it, and (from
    ``ProcessIdentity``) the process that serves it."""

    endpoint: EndpointId
    instance_id: int
    transport: TransportAddress

    def key(self) -> str:
        return instance_key(self.endpoint, self.instance_id)


def instance_key(endpoint: EndpointId, instance_id: int) -> str:
    return f"{INSTANCES_ROOT}/{endpoint.path()}/{instance_id:x}"


def mdc_key(endpoint: EndpointId, instance_id: int, lora_name: str | None = None) -> str:
    base = f"{MDC_ROOT}/{endpoint.path()}/{instance_id:x}"
    return f"{base}/{lora_name}" if lora_name else base


class RuntimeConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the engine tells the router about its capacity."""

    total_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    data_parallel_size: int = 1
    #: True when the worker publishes KV events (exact KV routing is possible).
    enable_kv_events: bool = False
    #: What the engine runs on (``--device-type``): ``DEVICE_CPU`` or ``DEVICE_GPU``; router
    #: mode ``device-aware-weighted`` counts any value but ``cpu`` as a GPU.
    device_type: str = "gpu"
    #: How a prefill worker hands its KV to decode workers (``protocols.disagg``):
    #: ``"pull"`` or ``"push"``; None: it cannot.
    kv_transfer: str | None = None


#: ``RuntimeConfig.device_type`` values.
DEVICE_CPU = "cpu"
DEVICE_GPU = "gpu"


#: The side handler (``ServingInstance.add_handler``) through which a worker serves the
#: artifacts its cards name; the request is an ``ArtifactRequest``, the response a stream of
#: raw byte chunks.
ARTIFACT_HANDLER = "artifact"
#: Artifact kind of a Hugging Face ``tokenizer.json`` (for GGUF models too: the worker builds
#: one from the GGUF's metadata).
KIND_HF_TOKENIZER_JSON = "hf_tokenizer_json"


Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class ArtifactRef(msgspec.Struct, frozen=True, kw_only=True):
    """A file the frontend needs to preprocess for a model, named by content, never by path.

    The card carries only this reference; the bytes travel over the request plane from any
    live instance that announces the same ``sha256`` (see ``ARTIFACT_HANDLER``), because
    frontends and workers run on different hosts and a multi-MB blob does not belong in the
    discovery store. ``sha256`` is of the exact bytes served, so instances of one model can be
    checked to agree, fetched bytes can be verified, and caches are content-addressed.

    A card whose reference lacks ``name`` or ``size`` (one that names a file by ``path``)
    does not decode (msgspec: "Object missing required field `name` - at `$.tokenizer`"), and
    the frontend's model watcher refuses it with that message and a hint to upgrade the
    worker. Unknown fields are ignored, so cards with more fields than this one still decode.
    """

    #: What the bytes are, for logs and cache file names (``"tokenizer.json"``).
    name: str
    #: How to interpret them (``KIND_HF_TOKENIZER_JSON``).
    kind: str
    #: Hex sha256 of the bytes (64 lowercase hex digits: it names cache files, so nothing
    #: else may pass, such as ``../`` from a hostile store entry).
    sha256: Sha256Hex
    #: Length of the bytes: a fetch that delivers more or fewer is refused.
    size: Annotated[int, msgspec.Meta(ge=0)]


class ArtifactRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Ask an instance's ``ARTIFACT_HANDLER`` for the artifact with ``sha256`` (msgpack)."""

    sha256: Sha256Hex


class ModelCapabilities(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a model's engine does beyond plain sampling. The frontend refuses a request that
    asks for more with a 400 naming the field, rather than accepting it and ignoring it.

    Defaults are what an engine that says nothing can do: none of it, but for ``cache_salt``.
    """

    #: Per-token log probabilities in responses, with at most this many alternatives each.
    logprobs: bool = False
    max_top_logprobs: int = 0
    #: vLLM's ``min_tokens``: no stop (EOS, stop tokens) before that many tokens.
    min_tokens: bool = False
    #: The engine partitions its prefix cache by ``cache_salt``: a salted prompt reuses only
    #: blocks cached under the same salt. It is what keeps tenants' caches apart
    #: (``llm.cache_salt``); the frontend refuses salted requests to a model without it.
    #: True by default, unlike the others, for a card written before the field existed:
    #: most such workers partition (mocker, vLLM), so True keeps their cards' checksum and
    #: their tenants served through an upgrade, and those that do not (attached SGLang and
    #: llama.cpp servers) still refuse a salted request themselves. An engine that cannot
    #: partition says False.
    cache_salt: bool = True
    #: Kinds of structured output the engine enforces while sampling (``json_object``,
    #: ``json_schema``, ``regex``, ``choice``, ``grammar``): ``response_format``, the
    #: ``guided_*`` fields and forced tool calls need them.
    structured_outputs: list[str] = msgspec.field(default_factory=list)
    #: How the model writes tool calls (a parser's name); None: requests with tools are
    #: refused, since a tool call would come back as plain text.
    tool_call_parser: str | None = None
    #: How the model writes its reasoning (a parser's name): it comes back as
    #: ``reasoning_content``, apart from the answer. None: all text is the answer.
    reasoning_parser: str | None = None


class LoraInfo(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    path: str | None = None


class ModelDeploymentCard(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Everything the frontend needs to serve a model, written by each of its instances."""

    #: The served model name (what clients put in ``"model"``).
    display_name: str
    endpoint: EndpointId
    instance_id: int
    model_type: ModelType
    model_input: ModelInput
    #: The tokenizer (``tokenizer.json`` bytes), fetched by content from the instances.
    tokenizer: ArtifactRef | None = None
    chat_template: str | None = None
    context_length: int = 4096
    kv_cache_block_size: int = 16
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    bos_token: str | None = None
    eos_token: str | None = None
    runtime_config: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    #: Set on the card of a loaded LoRA adapter (published under ``.../{instance_id:x}/{lora}``
    #: while the instance holds it; ``display_name`` is then the adapter's name).
    lora: LoraInfo | None = None
    #: On a base card: the LoRA adapters the instance can load on demand (loaded or not), so a
    #: frontend can send an adapter's first request to an instance that will load it.
    lora_adapters: list[str] = msgspec.field(default_factory=list)
    migration_limit: int = 0
    #: Which part of requests this instance runs. Prefill instances carry
    #: ``model_type = Prefill`` and the same ``display_name`` as the model they serve.
    worker_role: WorkerRole = WorkerRole.AGGREGATED
    #: What the engine can do beyond plain sampling (see ``ModelCapabilities``).
    capabilities: ModelCapabilities = msgspec.field(default_factory=ModelCapabilities)
    #: Embedding models: their vectors' length and properties (``ModelType.Embedding``).
    embedding: EmbeddingSpec | None = None
    #: Tensor models: their named inputs and outputs (``ModelType.TensorBased``).
    tensor: TensorModelSpec | None = None

    def artifacts(self) -> list[ArtifactRef]:
        """Every artifact this card names (what its worker must serve)."""
        return [self.tokenizer] if self.tokenizer is not None else []

    def checksum(self) -> str:
        """Digest of the fields that must agree between instances of one model.

        Artifacts enter by their content hash (cheap: the hash of a tokenizer JSON, computed
        once when the card is built), never by a path or the size of a weights file. The
        capabilities enter whole: the frontend checks requests against the served card's
        (structured outputs, log probabilities) and parses output with its tool-call and
        reasoning parsers, so an instance that does or parses otherwise is another card, not
        one more instance of the same one.
        """
        caps = self.capabilities
        caps = msgspec.structs.replace(caps, structured_outputs=sorted(caps.structured_outputs))
        h = hashlib.sha256()
        for part in (
            self.display_name,
            self.tokenizer.sha256 if self.tokenizer else "",
            self.chat_template or "",
            str(self.context_length),
            str(self.kv_cache_block_size),
            ",".join(map(str, self.eos_token_ids)),
            self.model_input.value,
            msgspec.json.encode(self.embedding).decode(),
            msgspec.json.encode(self.tensor).decode(),
            msgspec.json.encode(caps).decode(),
        ):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:16]
