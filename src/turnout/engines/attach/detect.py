"""Which API a server speaks, from what it answers, and the adapter for it.

Tried in order (each a cheap GET under the probe deadline):

* llama.cpp: ``GET /props`` is a JSON object with ``default_generation_settings``;
* SGLang: ``GET /get_model_info`` is a JSON object with ``model_path``;
* vLLM: ``GET /version`` is a JSON object with ``version`` and ``GET /v1/models`` names a
  ``max_model_len``;
* any other OpenAI-compatible server: ``GET /v1/models`` lists a model (text mode).

A server that answers none of these is ``UpstreamGarbage``; one that does not answer at
all raises ``Unreachable`` (the caller retries).
"""

from __future__ import annotations

from .api_base import TokensApi, first_model
from .llamacpp_api import LlamaCppApi
from .sglang_api import SglangApi
from .text_relay import OpenAiApi
from .upstream import Unreachable, Upstream, UpstreamError, UpstreamGarbage, UpstreamTimeout
from .vllm_api import VllmApi
from .vocab import VocabBytes

__all__ = ["API_NAMES", "TOKENS_APIS", "detect_api", "make_api"]

API_NAMES = ("vllm", "sglang", "llamacpp", "openai")
#: The APIs that take token ids (tokens mode); ``openai`` is text mode.
TOKENS_APIS = ("vllm", "sglang", "llamacpp")


def make_api(name: str, url: str, vocab: VocabBytes | None = None) -> TokensApi:
    if name == "llamacpp":
        return LlamaCppApi(url, vocab)
    if name == "vllm":
        return VllmApi(url)
    if name == "sglang":
        return SglangApi(url)
    if name == "openai":
        return OpenAiApi(url)
    raise ValueError(f"unknown API {name!r}; choose one of: {', '.join(API_NAMES)}")


async def _json_or_none(upstream: Upstream, path: str) -> object:
    try:
        return await upstream.get_json(path)
    except (Unreachable, UpstreamTimeout):
        raise
    except UpstreamError:
        return None


async def detect_api(upstream: Upstream) -> str:
    """The name of the API the server at ``upstream`` speaks (see the module doc)."""
    props = await _json_or_none(upstream, "/props")
    if isinstance(props, dict) and "default_generation_settings" in props:
        return "llamacpp"
    info = await _json_or_none(upstream, "/get_model_info")
    if isinstance(info, dict) and "model_path" in info:
        return "sglang"
    models = await _json_or_none(upstream, "/v1/models")
    version = await _json_or_none(upstream, "/version")
    if models is not None:
        try:
            model = first_model(upstream.base_url, models)
        except UpstreamGarbage:
            model = {}
        if isinstance(version, dict) and "version" in version and "max_model_len" in model:
            return "vllm"
        if model:
            return "openai"
    raise UpstreamGarbage(
        upstream.base_url,
        "answers none of llama.cpp's GET /props, SGLang's GET /get_model_info, vLLM's "
        "GET /version or an OpenAI GET /v1/models; is it an inference server? (--api "
        "names its API)",
    )
