"""The model card of an attached server: its numbers from the server, its tokenizer and chat
template from the user (``--tokenizer``), and the check that both tokenizers agree.

``TokenizerSource`` loads ``--tokenizer`` once per process (an HF folder with
``tokenizer.json``, or a GGUF: ``llm.model_card`` builds both into a card and publishes the
``tokenizer.json`` bytes as an artifact the worker serves to frontends). Without
``--tokenizer``, the path the server says it loaded its model from is used when it exists
on this machine (llama.cpp's ``/props`` ``model_path``, vLLM's model ``root``, SGLang's
``tokenizer_path``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

import msgspec

from turnout.errors import ConfigError
from turnout.llm.artifacts import LOCAL_ARTIFACTS
from turnout.llm.model_card import load_model_card
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.model import (
    DEVICE_GPU,
    EndpointId,
    ModelCapabilities,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    RuntimeConfig,
)

from ..echo import PLACEHOLDER_ENDPOINT
from .api_base import PROBE_TEXT, ServerInfo, TokensApi
from .llamacpp_api import DEFAULT_BLOCK_SIZE
from .text_relay import SALT_PARTITIONING_OWNERS
from .upstream import Upstream
from .vocab import VocabBytes, vocab_bytes

log = logging.getLogger("turnout.attach")

__all__ = ["TokenizerMismatch", "TokenizerSource", "text_card", "tokens_card"]

#: The context length of a text-mode card whose server does not say (frontends only use it
#: for limits they check before relaying).
TEXT_CONTEXT_LENGTH = 4096


class TokenizerMismatch(ConfigError):
    """The server's tokenizer and turnout's disagree on the probe text."""


@dataclass(slots=True)
class _Loaded:
    path: str
    card: ModelDeploymentCard
    tokenizer: Tokenizer
    vocab: VocabBytes


class TokenizerSource:
    """``--tokenizer``, loaded on first use (see the module doc)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._loaded: _Loaded | None = None
        self._lock = asyncio.Lock()

    @property
    def loaded(self) -> _Loaded:
        if self._loaded is None:
            raise RuntimeError("the tokenizer is not loaded yet")
        return self._loaded

    async def load(self, info: ServerInfo, url: str) -> _Loaded:
        async with self._lock:
            if self._loaded is not None:
                return self._loaded
            path = self.path
            if path is None:
                candidate = info.model_path
                if candidate and _has_tokenizer(candidate):
                    log.info("%s: using the server's own model files as tokenizer: %s", url,
                             candidate)  # fmt: skip
                    path = candidate
                else:
                    raise ConfigError(
                        f"--tokenizer is required for {url} (tokens mode: the frontend "
                        "tokenizes with it); give the model's Hugging Face folder or GGUF file"
                    )
            card = await asyncio.to_thread(load_model_card, path, endpoint=PLACEHOLDER_ENDPOINT)
            assert card.tokenizer is not None  # load_model_card always builds one
            data = LOCAL_ARTIFACTS.get(card.tokenizer.sha256)
            assert data is not None  # published by load_model_card
            tokenizer = Tokenizer.from_bytes(data, origin=path)
            self._loaded = _Loaded(
                path, card, tokenizer, await asyncio.to_thread(vocab_bytes, data)
            )
            return self._loaded


def _has_tokenizer(path: str) -> bool:
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, "tokenizer.json"))
    return os.path.isfile(path) and path.lower().endswith(".gguf")


async def check_tokenizer(api: TokensApi, upstream: Upstream, loaded: _Loaded) -> None:
    """``TokenizerMismatch`` (one line naming both results) unless the server encodes the
    probe text as turnout's tokenizer does."""
    ours = loaded.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    theirs = await api.tokenize(upstream, PROBE_TEXT)
    if ours == theirs:
        return
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
              min(len(ours), len(theirs)))  # fmt: skip
    raise TokenizerMismatch(
        f"{upstream.base_url}: tokenizer mismatch on the probe text {PROBE_TEXT[:24]!r}...: "
        f"turnout's tokenizer ({loaded.path}) gives {len(ours)} ids {_ids(ours, at)}, the "
        f"{api.label} server gives {len(theirs)} ids {_ids(theirs, at)} (first difference at "
        f"position {at}); give --tokenizer the model the server runs"
    )


def _ids(ids: list[int], at: int) -> str:
    start = max(0, at - 2)
    window = ids[start : start + 6]
    return (
        ("[..., " if start else "[")
        + ", ".join(map(str, window))
        + (", ...]" if start + 6 < len(ids) else "]")
    )


def resolve_block_size(info: ServerInfo, asked: int | None, url: str) -> int:
    """``--block-size`` if given (warning when the server says otherwise), else the
    server's, else llama.cpp's default (it has no KV blocks); vLLM and SGLang must say."""
    if asked is not None:
        if info.block_size is not None and info.block_size != asked:
            log.warning("%s: the server's KV block size is %d; --block-size %d is used for the "
                        "card", url, info.block_size, asked)  # fmt: skip
        return asked
    if info.block_size is not None:
        return info.block_size
    if info.api == "llamacpp":
        log.info("%s: llama.cpp has no KV block size; the card uses %d tokens (--block-size "
                 "sets another)", url, DEFAULT_BLOCK_SIZE)  # fmt: skip
        return DEFAULT_BLOCK_SIZE
    raise ConfigError(
        f"{url}: the {info.api} server does not say its KV block size (its metrics are off?); "
        "give --block-size"
    )


def tokens_card(
    loaded: _Loaded,
    info: ServerInfo,
    api: TokensApi,
    *,
    name: str,
    block_size: int,
    kv_events: bool,
    dp_size: int = 1,
) -> ModelDeploymentCard:
    """The card of a tokens-mode instance."""
    base = loaded.card
    context = info.context_length or base.context_length
    return msgspec.structs.replace(
        base,
        display_name=name,
        model_type=ModelType.Chat | ModelType.Completions,
        model_input=ModelInput.Tokens,
        context_length=context,
        kv_cache_block_size=block_size,
        runtime_config=RuntimeConfig(
            total_kv_blocks=info.total_kv_blocks,
            max_num_seqs=info.max_num_seqs,
            data_parallel_size=dp_size,
            enable_kv_events=kv_events,
            device_type="cpu" if info.api == "llamacpp" else DEVICE_GPU,
        ),
        capabilities=api.capabilities(),
    )


def text_card(info: ServerInfo, *, name: str, endpoint: EndpointId) -> ModelDeploymentCard:
    """The card of a text-mode instance: chat and completions, relayed. It says the server
    partitions its prefix cache by ``cache_salt`` only for a server known to
    (``SALT_PARTITIONING_OWNERS``): the frontend refuses salted requests to any other, since
    the relay passes the salt on and a server that ignores it would let tenants share its
    cache."""
    return ModelDeploymentCard(
        display_name=name,
        endpoint=endpoint,
        instance_id=0,
        model_type=ModelType.Chat | ModelType.Completions,
        model_input=ModelInput.Text,
        context_length=info.context_length or TEXT_CONTEXT_LENGTH,
        capabilities=ModelCapabilities(cache_salt=info.owned_by in SALT_PARTITIONING_OWNERS),
    )
