"""``turnout_prompt_cache_*``: what the prompt cache (``llm.prompt_cache``) saved, read at
scrape time (no cost on the request path).

* ``turnout_prompt_cache_prompts_total``: chat prompts encoded; of those,
  ``turnout_prompt_cache_uncached_prompts_total`` encoded whole (the cache off, or a
  tokenizer without clean cuts).
* ``turnout_prompt_cache_pieces_total{result}``: pieces found (``hit``) or encoded (``miss``).
* ``turnout_prompt_cache_tokens_encoded_total``: tokens the tokenizer produced, and
  ``turnout_prompt_cache_tokens_reused_total`` tokens taken from the cache: their sum is
  every prompt token, the first over ``prompts_total`` the tokens encoded per request.
* ``turnout_prompt_cache_evictions_total``; ``turnout_prompt_cache_entries``,
  ``turnout_prompt_cache_tokens``, ``turnout_prompt_cache_bytes`` (what it holds) and
  ``turnout_prompt_cache_capacity_bytes`` (its bound, ``--prompt-cache-mib``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from turnout.llm.prompt_cache import PromptCache

_PREFIX = "turnout_prompt_cache_"


class PromptCacheCollector(Collector):
    def __init__(self, cache: PromptCache) -> None:
        self._cache = cache

    def collect(self) -> Iterator[Any]:
        cache = self._cache
        s = cache.stats
        yield CounterMetricFamily(_PREFIX + "prompts", "Chat prompts encoded", value=s.prompts)
        yield CounterMetricFamily(
            _PREFIX + "uncached_prompts",
            "Chat prompts encoded whole (cache off, or a tokenizer without clean cuts)",
            value=s.uncached_prompts,
        )
        pieces = CounterMetricFamily(
            _PREFIX + "pieces", "Prompt pieces found in the cache (hit) or encoded (miss)",
            labels=["result"],
        )  # fmt: skip
        pieces.add_metric(["hit"], s.pieces_hit)
        pieces.add_metric(["miss"], s.pieces_missed)
        yield pieces
        yield CounterMetricFamily(
            _PREFIX + "tokens_encoded", "Prompt tokens the tokenizer produced",
            value=s.tokens_encoded,
        )  # fmt: skip
        yield CounterMetricFamily(
            _PREFIX + "tokens_reused", "Prompt tokens taken from the cache", value=s.tokens_reused
        )
        yield CounterMetricFamily(
            _PREFIX + "evictions", "Entries dropped to stay within the bound", value=s.evictions
        )
        yield GaugeMetricFamily(_PREFIX + "entries", "Pieces held", value=cache.num_entries)
        yield GaugeMetricFamily(_PREFIX + "tokens", "Token ids held", value=cache.num_tokens)
        yield GaugeMetricFamily(
            _PREFIX + "bytes", "Memory the held pieces take (estimated)", value=cache.num_bytes
        )
        yield GaugeMetricFamily(
            _PREFIX + "capacity_bytes", "The cache's bound (0: off)", value=cache.max_bytes
        )
