"""Builds each model's pipelines for the model watcher, from its card and endpoint client.

One factory per frontend: it holds what pipelines of one model share (a KV router, load
counts, session tables, the prefill slot) and what every model shares (router mode, timeouts,
the artifact fetcher). Which pipelines a card gets is the watcher's decision
(``frontend.models.watcher``); how each is put together is decided here.

A model may have pipelines of several cards at once (a rolling upgrade: the served card and
standby ones, each routed through its own view of the endpoint). What pipelines share is
kept per card (``CardRouting``: one KV router, one load table, one session table), so that
a card's requests are scored, counted and pinned among its own instances only. The maps read
per model name (``kv_routers``, ``session_tables``, ``served``) hold the card the watcher
says is served (``serving``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from turnout.errors import ConfigError, TemplateLimitExceeded
from turnout.frontend.access.cache_space import CacheSpaces
from turnout.frontend.metrics.disagg import DisaggMetrics
from turnout.frontend.metrics.frontend import FrontendMetrics
from turnout.frontend.models.accepted_instances import ModelClient
from turnout.frontend.models.artifacts import ArtifactFetcher
from turnout.frontend.models.pairs import InvalidCard
from turnout.frontend.models.pipeline import TextPipeline, TokensPipeline, WorkerGate
from turnout.frontend.unary.embeddings import EmbeddingsPipeline
from turnout.frontend.unary.tensor import TensorPipeline
from turnout.llm.backend import Backend
from turnout.llm.chat_template import ChatTemplate
from turnout.llm.limits import RequestLimits
from turnout.llm.migration import Migration
from turnout.llm.preprocessor import Preprocessor
from turnout.llm.prompt_cache import PromptCache
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.llm import LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import ModelDeploymentCard
from turnout.protocols.unary import EmbeddingOutput, TensorOutput
from turnout.router.instance_load import InstanceLoad
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.push import KvPushRouter
from turnout.router.kv.router import KvRouter
from turnout.router.load_reports import BusyReports
from turnout.router.lora import LoraRegistry, LoraSelector
from turnout.router.mode import RouterMode
from turnout.router.prefill_router import PrefillRouter
from turnout.router.prefill_slots import EngineFn, PrefillPool, PrefillSlots
from turnout.router.push_router import PushRouter
from turnout.router.selectors import InstanceSelector, make_selector
from turnout.router.session_affinity import MAX_TTL_S, SessionAffinityRouter, SessionTable
from turnout.router.unary import UnaryCaller
from turnout.runtime.event_plane import EventPlane

_msgpack_encode = msgspec.msgpack.Encoder().encode
#: Router modes that read the push router's in-flight counts.
LOAD_MODES = frozenset(
    {RouterMode.POWER_OF_TWO, RouterMode.LEAST_LOADED, RouterMode.DEVICE_AWARE_WEIGHTED}
)
_output_decoder = msgspec.msgpack.Decoder(LLMEngineOutput)
_embedding_decoder = msgspec.msgpack.Decoder(EmbeddingOutput)
_tensor_decoder = msgspec.msgpack.Decoder(TensorOutput)


def _identity(raw: bytes) -> bytes:
    return raw


@dataclass(slots=True, eq=False)
class CardRouting:
    """What the pipelines of one card of a model share (its chat and completions ones):
    created with the first pipeline that needs each part, freed by ``release``."""

    card: ModelDeploymentCard
    #: The card's routing view, which every part below follows.
    client: ModelClient
    kv_router: KvRouter | None = None
    session_table: SessionTable | None = None
    #: The load view the card's push routers share (in-flight counts, busy instances), the
    #: listener that forgets instances leaving the endpoint, the feed of the workers' load
    #: reports into it, and (load-based modes) the selector reading it.
    load: InstanceLoad | None = None
    selector: InstanceSelector | None = None
    prune: Callable[[], None] | None = None
    busy_reports: BusyReports | None = None


class PipelineFactory:
    """Builds pipelines for the model watcher (the ``models.pairs.PipelineFactory``
    protocol)."""

    def __init__(
        self,
        *,
        router_mode: RouterMode = RouterMode.ROUND_ROBIN,
        migration_limit: int = 3,
        metrics: FrontendMetrics | None = None,
        router_seed: int | None = None,
        kv_config: KvRouterConfig | None = None,
        kv_share_active: bool = True,
        event_plane: EventPlane | None = None,
        min_initial_workers: int = 0,
        artifacts: ArtifactFetcher | None = None,
        request_timeout: float = 0.0,
        ttft_timeout: float = 0.0,
        stall_timeout: float = 0.0,
        session_affinity_ttl_s: float | None = None,
        lora: LoraRegistry | None = None,
        device_types: Callable[[str], Mapping[int, str]] | None = None,
        cpu_gpu_ratio: int | None = None,
        prefill_min_tokens: int = 512,
        decode_fallback: bool = True,
        disagg_metrics: DisaggMetrics | None = None,
        limits: RequestLimits | None = None,
        max_artifact_bytes: int | None = None,
        prompt_cache: PromptCache | None = None,
        cache_spaces: CacheSpaces | None = None,
    ) -> None:
        # Fail at start-up for a mode that is not built, not at the first request.
        if router_mode is not RouterMode.KV:
            make_selector(router_mode, seed=router_seed, cpu_gpu_ratio=cpu_gpu_ratio)
        elif event_plane is None:
            raise ValueError("router mode kv needs the event plane")
        if min_initial_workers < 0:
            raise ConfigError(
                f"--router-min-initial-workers must be >= 0, got {min_initial_workers}"
            )
        self.min_initial_workers = min_initial_workers
        #: What one request may ask for, checked by every model's preprocessor.
        self.limits = limits if limits is not None else RequestLimits()
        for flag, value in (
            ("--request-timeout", request_timeout),
            ("--ttft-timeout", ttft_timeout),
            ("--stall-timeout", stall_timeout),
        ):
            if not (value >= 0) or value == float("inf"):
                raise ConfigError(f"{flag} must be a finite number of seconds >= 0, got {value}")
        #: Seconds (0: none): a request's whole deadline, the silence allowed before an
        #: attempt's first output, and between outputs (see ``Migration``).
        self.request_timeout = request_timeout
        self.ttft_timeout = ttft_timeout
        self.stall_timeout = stall_timeout
        self.router_mode = router_mode
        self.migration_limit = migration_limit
        self.metrics = metrics
        self.router_seed = router_seed
        self.kv_config = kv_config or KvRouterConfig()
        self.kv_share_active = kv_share_active
        self.event_plane = event_plane
        #: Where tokenizers come from: fetched by content from the model's instances, cached.
        #: ``max_artifact_bytes`` (``--max-artifact-bytes``) bounds what it takes; None: the
        #: fetcher's own bound.
        self.artifacts = artifacts or ArtifactFetcher()
        if max_artifact_bytes is not None:
            if max_artifact_bytes < 1:
                raise ConfigError(
                    f"--max-artifact-bytes must be at least 1, got {max_artifact_bytes}"
                )
            self.artifacts.max_bytes = max_artifact_bytes
        #: Per card, by the routing view its pipelines were built with (a card that leaves
        #: and comes back gets a new view, and fresh state): what its pipelines share.
        self.cards: dict[ModelClient, CardRouting] = {}
        #: Per model name, the served card's routing, KV router and session table (for
        #: busy thresholds, metrics and tests).
        self.served: dict[str, CardRouting] = {}
        self.kv_routers: dict[str, KvRouter] = {}
        self.session_tables: dict[str, SessionTable] = {}
        #: ``--router-session-affinity-ttl-secs`` (None: off); one binding table per model,
        #: shared by its chat and completions pipelines (see ``router.session_affinity``).
        if session_affinity_ttl_s is not None and not (0 < session_affinity_ttl_s <= MAX_TTL_S):
            raise ConfigError(
                "--router-session-affinity-ttl-secs must be seconds > 0 and at most "
                f"{MAX_TTL_S:g} (a year), got {session_affinity_ttl_s}"
            )
        self.session_affinity_ttl_s = session_affinity_ttl_s
        #: ``--enable-lora``: adapter requests go only to instances holding (or loading) the
        #: adapter (see ``router.lora``); None: LoRA serving off.
        self.lora = lora
        self.device_types = device_types
        self.cpu_gpu_ratio = cpu_gpu_ratio
        #: Disaggregated serving: each model's prefill side, activated by the model watcher
        #: (``frontend.models.prefill_watch``) while it has prefill instances.
        if prefill_min_tokens < 0:
            raise ConfigError(f"--prefill-min-tokens must be >= 0, got {prefill_min_tokens}")
        self.prefill_slots = PrefillSlots()
        self.prefill_min_tokens = prefill_min_tokens
        self.decode_fallback = decode_fallback
        self.disagg_metrics = disagg_metrics
        #: Chat prompts' pieces' ids, shared by every model's preprocessor (None: none).
        self.prompt_cache = prompt_cache
        #: Which cache space each request's prompt hashes into (``--shared-cache-tenants``).
        self.cache_spaces = cache_spaces if cache_spaces is not None else CacheSpaces()

    def _routing(self, card: ModelDeploymentCard, client: ModelClient) -> CardRouting:
        """The shared parts of the pipelines of ``card`` routed through ``client``."""
        routing = self.cards.get(client)
        if routing is None:
            routing = self.cards[client] = CardRouting(card, client)
        return routing

    def _router(
        self, card: ModelDeploymentCard, client: ModelClient, **codec: Any
    ) -> PushRouter[Any, Any]:
        mode = self.router_mode
        if mode is RouterMode.KV:
            # Text-input models send no tokens to hash: spread them round-robin.
            mode = RouterMode.ROUND_ROBIN
        if mode in LOAD_MODES:
            load, selector = self._load_selector(self._routing(card, client))
            return PushRouter(
                client,
                self._lora_selector(selector),
                endpoint_name=card.endpoint.path(),
                load=load,
                **codec,
            )
        return PushRouter(
            client,
            self._lora_selector(make_selector(mode, seed=self.router_seed)),
            endpoint_name=card.endpoint.path(),
            load=self._card_load(self._routing(card, client)),
            **codec,
        )

    def _card_load(self, routing: CardRouting) -> InstanceLoad:
        """The card's load view: busy instances (refusals, and the workers' own load
        reports) are skipped in every mode; instances leaving the endpoint are forgotten."""
        if routing.load is not None:
            return routing.load
        load = routing.load = InstanceLoad()
        client = routing.client

        def prune() -> None:
            load.retain(client.announced_ids())

        client.add_listener(prune)
        routing.prune = prune
        if self.event_plane is not None:
            routing.busy_reports = BusyReports(
                self.event_plane,
                routing.card.endpoint,
                load,
                announced=lambda instance_id: client.get_instance(instance_id) is not None,
            )
            routing.busy_reports.start()
        return load

    def _load_selector(self, routing: CardRouting) -> tuple[InstanceLoad, InstanceSelector]:
        """The card's in-flight counts and load-based selector, forgetting instances that
        leave the endpoint."""
        load = self._card_load(routing)
        if routing.selector is not None:
            return load, routing.selector
        accessor = self.device_types
        name = routing.card.display_name
        selector = make_selector(
            self.router_mode,
            seed=self.router_seed,
            load=load,
            device_types=(lambda: accessor(name)) if accessor is not None else None,
            cpu_gpu_ratio=self.cpu_gpu_ratio,
        )
        routing.selector = selector
        return load, selector

    async def _drop(self, routing: CardRouting) -> None:
        """Forget ``routing`` and close what it holds (its KV router, its load-report
        feed)."""
        if self.cards.get(routing.client) is routing:
            del self.cards[routing.client]
        name = routing.card.display_name
        if self.served.get(name) is routing:
            del self.served[name]
            self.kv_routers.pop(name, None)
            self.session_tables.pop(name, None)
        if routing.prune is not None:
            routing.client.remove_listener(routing.prune)
            routing.prune = None
        router, routing.kv_router = routing.kv_router, None
        reports, routing.busy_reports = routing.busy_reports, None
        try:
            if reports is not None:
                await reports.aclose()
        finally:
            if router is not None:
                await router.close()

    def _lora_selector(self, selector: InstanceSelector) -> InstanceSelector:
        return selector if self.lora is None else LoraSelector(selector, self.lora)

    def _gate(self, client: ModelClient) -> WorkerGate | None:
        if self.min_initial_workers <= 1:
            return None
        return WorkerGate(client, self.min_initial_workers)

    async def _kv_router(self, routing: CardRouting) -> KvRouter:
        """The card's KV router: it scores and tracks only the card's instances."""
        if routing.kv_router is not None:
            return routing.kv_router
        card = routing.card
        assert self.event_plane is not None
        config = msgspec.structs.replace(self.kv_config, block_size=card.kv_cache_block_size)
        router = KvRouter(
            config,
            routing.client,
            self.event_plane,
            card.endpoint,
            dp_size=card.runtime_config.data_parallel_size,
            share_active=self.kv_share_active,
        )
        await router.start()
        routing.kv_router = router
        self._publish(routing)
        return router

    def _session_table(self, routing: CardRouting) -> SessionTable:
        if routing.session_table is None:
            assert self.session_affinity_ttl_s is not None
            routing.session_table = SessionTable(self.session_affinity_ttl_s)
            self._publish(routing)
        return routing.session_table

    def _publish(self, routing: CardRouting) -> None:
        """Expose ``routing``'s parts under its model's name when it is the served card."""
        name = routing.card.display_name
        if self.served.get(name) is not routing:
            return
        if routing.kv_router is not None:
            self.kv_routers[name] = routing.kv_router
        if routing.session_table is not None:
            self.session_tables[name] = routing.session_table

    def serving(self, card: ModelDeploymentCard, client: ModelClient) -> None:
        """The pipelines of ``card`` over ``client`` are the ones registered for its model
        now."""
        name = card.display_name
        self.kv_routers.pop(name, None)
        self.session_tables.pop(name, None)
        routing = self.cards.get(client)
        if routing is None:
            self.served.pop(name, None)
            return
        self.served[name] = routing
        self._publish(routing)

    async def build_prefill_pool(
        self, card: ModelDeploymentCard, client: ModelClient
    ) -> PrefillPool:
        """The router among a model's prefill workers (its prefill card, its endpoint):
        KV-aware in KV mode (the prompt goes where most of it is cached, weighed against
        load), else the configured mode's selector."""
        if self.router_mode is RouterMode.KV:
            assert self.event_plane is not None
            config = msgspec.structs.replace(self.kv_config, block_size=card.kv_cache_block_size)
            kv_router = KvRouter(
                config,
                client,
                self.event_plane,
                card.endpoint,
                dp_size=card.runtime_config.data_parallel_size,
                share_active=self.kv_share_active,
            )
            await kv_router.start()
            generate = KvPushRouter(kv_router).generate
            return PrefillPool(card.endpoint, client, generate, card.checksum(), kv_router)
        mode = self.router_mode
        load = InstanceLoad() if mode in LOAD_MODES else None
        selector = make_selector(
            mode, seed=self.router_seed, load=load, cpu_gpu_ratio=self.cpu_gpu_ratio
        )
        router = PushRouter(
            client,
            selector,
            endpoint_name=card.endpoint.path(),
            load=load,
            encode=_msgpack_encode,
            decode=_output_decoder.decode,
        )
        return PrefillPool(card.endpoint, client, router.generate, card.checksum())

    async def release(self, card: ModelDeploymentCard, client: ModelClient) -> None:
        """No pipeline of ``card`` over ``client`` is kept: close its KV router, forget its
        tables."""
        routing = self.cards.get(client)
        if routing is None:
            return
        await self._drop(routing)

    async def close(self) -> None:
        for pool in self.prefill_slots.deactivate_all():
            await pool.close()
        for routing in list(self.cards.values()):
            await self._drop(routing)

    async def _tokenizer(self, card: ModelDeploymentCard, client: ModelClient) -> Tokenizer:
        """The card's tokenizer, by content from the workers (or the caches), never from a
        path: ``ArtifactError`` when no instance delivers it (the watcher builds nothing)."""
        if card.tokenizer is None:
            raise ValueError(f"model {card.display_name!r} has Tokens input but no tokenizer")
        return await self.artifacts.tokenizer(
            card.tokenizer,
            client,
            prefer=card.instance_id,
            bos_token=card.bos_token,
            eos_token=card.eos_token,
        )

    @property
    def max_artifact_bytes(self) -> int:
        """The largest artifact a card may name (the model watcher refuses larger)."""
        return self.artifacts.max_bytes

    async def _chat_template(self, card: ModelDeploymentCard) -> ChatTemplate:
        """The card's chat template, compiled and probed off the event loop: ``InvalidCard``
        when it does not compile or runs past its budget on a small conversation (it would
        on every request)."""
        source = card.chat_template
        if not source:
            raise ValueError(f"chat model {card.display_name!r} has no chat template")

        def load() -> ChatTemplate:
            template = ChatTemplate(source, card.bos_token, card.eos_token)
            template.probe()
            return template

        try:
            return await asyncio.to_thread(load)
        except (ConfigError, TemplateLimitExceeded) as err:
            raise InvalidCard("chat_template", str(err)) from err

    async def _tokens_pipeline(
        self, card: ModelDeploymentCard, client: ModelClient, *, is_chat: bool
    ) -> TokensPipeline:
        # The template first: refusing a card for it costs no tokenizer fetch.
        template = await self._chat_template(card) if is_chat else None
        tokenizer = await self._tokenizer(card, client)
        # The preprocessor's fit check and prompt cache read these: computed once per
        # tokenizer, not on the loop.
        await asyncio.to_thread(lambda: (tokenizer.max_token_chars, tokenizer.boundaries))
        routing = self._routing(card, client)
        router: KvPushRouter | PushRouter[PreprocessedRequest, LLMEngineOutput]
        if self.router_mode is RouterMode.KV:
            router = KvPushRouter(
                await self._kv_router(routing),
                allow=self.lora.allowed if self.lora is not None else None,
            )
        else:
            router = self._router(
                card, client, encode=_msgpack_encode, decode=_output_decoder.decode
            )
        migrations = self.metrics.migrations.labels(card.display_name) if self.metrics else None
        generate: EngineFn = router.generate
        if self.session_affinity_ttl_s is not None:
            generate = SessionAffinityRouter(
                generate, self._session_table(routing), client
            ).generate
        generate = self._prefill_router(card, generate, router).generate
        migration = Migration(
            generate,
            migration_limit=self.migration_limit,
            on_migration=migrations.inc if migrations is not None else None,
            request_timeout=self.request_timeout,
            ttft_timeout=self.ttft_timeout,
            stall_timeout=self.stall_timeout,
            report_down=client.report_instance_down,
            report_busy=router.load.mark_busy if isinstance(router, PushRouter) else None,
        )
        return TokensPipeline(
            name=card.display_name,
            card=card,
            preprocessor=Preprocessor(
                card, tokenizer, template, self.limits, prompt_cache=self.prompt_cache
            ),
            backend=Backend(tokenizer),
            migration=migration,
            client=client,
            is_chat=is_chat,
            gate=self._gate(client),
            cache_spaces=self.cache_spaces,
        )

    def _prefill_router(
        self,
        card: ModelDeploymentCard,
        decode: EngineFn,
        router: KvPushRouter | PushRouter[PreprocessedRequest, LLMEngineOutput],
    ) -> PrefillRouter:
        # The decode worker is chosen before the prefill (push target, conditional prefill)
        # where the KV router decides alone; with session affinity the session's binding
        # decides, at dispatch.
        decode_kv = router if isinstance(router, KvPushRouter) else None
        if self.session_affinity_ttl_s is not None:
            decode_kv = None
        metrics = self.disagg_metrics
        return PrefillRouter(
            self.prefill_slots.slot(card.display_name),
            decode,
            checksum=card.checksum(),
            role=card.worker_role,
            decode_endpoint=card.endpoint,
            block_size=card.kv_cache_block_size,
            min_tokens=self.prefill_min_tokens,
            fallback=self.decode_fallback,
            decode_kv=decode_kv,
            observer=metrics.observer(card.display_name) if metrics is not None else None,
        )

    async def build_chat(self, card: ModelDeploymentCard, client: ModelClient) -> TokensPipeline:
        return await self._tokens_pipeline(card, client, is_chat=True)

    async def build_completions(
        self, card: ModelDeploymentCard, client: ModelClient
    ) -> TokensPipeline:
        return await self._tokens_pipeline(card, client, is_chat=False)

    async def build_text_chat(self, card: ModelDeploymentCard, client: ModelClient) -> TextPipeline:
        return self._text_pipeline(card, client, is_chat=True)

    async def build_text_completions(
        self, card: ModelDeploymentCard, client: ModelClient
    ) -> TextPipeline:
        return self._text_pipeline(card, client, is_chat=False)

    def _text_pipeline(
        self, card: ModelDeploymentCard, client: ModelClient, *, is_chat: bool
    ) -> TextPipeline:
        router = self._router(card, client, encode=_identity, decode=_identity)
        return TextPipeline(
            card.display_name,
            card,
            router,
            client,
            is_chat=is_chat,
            gate=self._gate(client),
            request_timeout=self.request_timeout,
            cache_spaces=self.cache_spaces,
        )

    async def build_embeddings(
        self, card: ModelDeploymentCard, client: ModelClient
    ) -> EmbeddingsPipeline:
        """Tokens + Embedding: tokenize here, route (no KV routing: nothing is cached), reply."""
        if card.embedding is None:
            raise ValueError(
                f"embedding model {card.display_name!r} does not say its vectors' length "
                "(card field 'embedding')"
            )
        tokenizer = await self._tokenizer(card, client)
        caller = self._unary_caller(card, client, _embedding_decoder.decode)
        return EmbeddingsPipeline(
            card.display_name, card, tokenizer, caller, client, gate=self._gate(client)
        )

    async def build_tensor(self, card: ModelDeploymentCard, client: ModelClient) -> TensorPipeline:
        """Tensor + TensorBased: checked against the card's tensors, routed, one reply."""
        if card.tensor is None:
            raise ValueError(
                f"tensor model {card.display_name!r} does not declare its tensors "
                "(card field 'tensor')"
            )
        caller = self._unary_caller(card, client, _tensor_decoder.decode)
        return TensorPipeline(card.display_name, card, caller, client, gate=self._gate(client))

    def _unary_caller(
        self, card: ModelDeploymentCard, client: ModelClient, decode: Callable[[bytes], Any]
    ) -> UnaryCaller[Any, Any]:
        """Routes a one-reply request (no KV routing: nothing is cached), sent again to
        another instance when one fails, under ``--request-timeout``."""
        router = self._router(card, client, encode=_msgpack_encode, decode=decode)
        retries = self.metrics.migrations.labels(card.display_name) if self.metrics else None
        return UnaryCaller(
            router.generate,
            retries=self.migration_limit,
            request_timeout=self.request_timeout,
            report_down=client.report_instance_down,
            report_busy=router.load.mark_busy,
            on_retry=retries.inc if retries is not None else None,
        )
