r"""The prompt cache: token ids of prompt pieces seen before, so a chat prompt is encoded
only where it is new.

In multi-turn chat every request repeats the conversation so far, and encoding is the
costly part of preprocessing (about 2 µs a token on SmolLM2's tokenizer, 20 times the
template's rendering). The template is still rendered whole, so the text is exactly what a
full render gives; what is cached is the text's encoding, piece by piece::

    piece                        cache
    "<|im_start|>"               hit
    "system\nBe brief<|im_end|>" hit
    "\n<|im_start|>"             hit
    "user\nHi<|im_end|>"         miss ┐ the missed pieces joined, encoded in one call,
    "\n<|im_start|>"             hit  │ the ids split at each piece's end
    "assistant\n"                miss ┘

The pieces end at *clean cuts* (``llm.token_boundaries``: right after a special token such as
``<|im_end|>``, where the tokenizer's output splits into the pieces' own ids), so the
prompt's ids are the concatenation of its pieces' ids, whatever came before each piece.
Pieces not in the cache are joined and encoded in one call (one call costs less than
several), and the result is split at the pieces' ends (``Encoding.char_to_token``). Nothing
in the cache depends on the template, the request's options or the model: only on the
tokenizer (its sha256 is part of every key) and on the piece's text, so different models,
templates, tools or ``chat_template_kwargs`` can share a piece only where it is the same
text for the same tokenizer, which encodes the same. The request's cache space (its cache
salt: its tenant's, and the client's own) is part of every key too: a piece is reused only
within its space, so no tenant can learn, from a faster answer, that another sent the same
message, as the engines' prefix caches are kept apart for the same reason.

Bounded: an LRU over pieces, within ``max_bytes`` (each entry's text, ids and bookkeeping;
entries and tokens are bounded by that too). Shared by a frontend's models and safe across
threads (large prompts are encoded off the event loop): the lock is held for lookups and
inserts, never while encoding. A tokenizer without clean cuts is encoded whole, as is every
prompt when the cache is off (``max_bytes`` 0); both still count in the stats.
"""

from __future__ import annotations

import logging
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .token_boundaries import TokenBoundaries
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: The default bound on the cache's memory.
DEFAULT_MAX_BYTES = 64 << 20
#: What an entry costs besides its text and ids: its key tuple, its array's header, its
#: place in the ordered dict (about 250 bytes, as tracemalloc measures 22,000 entries).
ENTRY_OVERHEAD_BYTES = 248
#: One piece may take at most this share of the cache (a huge document does not flush it).
_MAX_PIECE_SHARE = 8

_Key = tuple[str, str]


@dataclass(slots=True)
class PromptCacheStats:
    """What the cache's encoders did, since the cache was made. Changed under the cache's
    lock by its encoders only."""

    #: Prompts encoded.
    prompts: int = 0
    #: Of those, prompts encoded whole (the cache off, a tokenizer without clean cuts).
    uncached_prompts: int = 0
    #: Pieces found in the cache, and not.
    pieces_hit: int = 0
    pieces_missed: int = 0
    #: Tokens taken from the cache, and tokens the tokenizer produced.
    tokens_reused: int = 0
    tokens_encoded: int = 0
    #: Entries dropped to stay within the bound.
    evictions: int = 0


class PromptEncoder(Protocol):
    """Encodes rendered chat prompts (``add_special_tokens=False``) for one tokenizer."""

    def encode(self, text: str, space: str | None = None) -> list[int]:
        """``space``: the request's cache space (its cache salt; None: the un-salted one)."""
        ...


class UncachedEncoder:
    """A ``PromptEncoder`` without a cache: every prompt encoded whole, nothing counted."""

    __slots__ = ("_tokenizer",)

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str, space: str | None = None) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


class PromptCache:
    """Token ids of prompt pieces, per tokenizer, in an LRU bounded by ``max_bytes``."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.stats = PromptCacheStats()
        self._lock = threading.Lock()
        #: (tokenizer sha256 [NUL cache space], piece) -> its ids; least recently used first.
        self._entries: OrderedDict[_Key, array[int]] = OrderedDict()
        self._bytes = 0
        self._tokens = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def encoder(self, tokenizer: Tokenizer) -> PromptEncoder:
        """An encoder of prompts for ``tokenizer`` that uses this cache where it can.

        Reads ``tokenizer.boundaries`` (computed once per tokenizer: warm it off the event
        loop)."""
        if not self.enabled:
            return _WholeEncoder(tokenizer, self)
        boundaries = tokenizer.boundaries
        if isinstance(boundaries, str):
            log.info(
                "prompt cache off for a tokenizer",
                extra={"tokenizer": tokenizer.sha256[:12], "reason": boundaries},
            )
            return _WholeEncoder(tokenizer, self)
        return _PieceEncoder(tokenizer, boundaries, self)

    # ------------------------------------------------------------ used by the encoders

    def _count_whole(self, n_tokens: int) -> None:
        with self._lock:
            stats = self.stats
            stats.prompts += 1
            stats.uncached_prompts += 1
            stats.tokens_encoded += n_tokens

    def _take(self, keys: Sequence[_Key]) -> list[array[int] | None]:
        """The cached ids of each key (None where absent), each found one marked used."""
        entries = self._entries
        found: list[array[int] | None] = []
        with self._lock:
            for key in keys:
                ids = entries.get(key)
                if ids is not None:
                    entries.move_to_end(key)
                found.append(ids)
        return found

    def _put(
        self,
        keys: Sequence[_Key],
        found: Sequence[array[int] | None],
        new: dict[_Key, array[int]],
    ) -> None:
        """Count a prompt of pieces ``keys``, of which ``found`` were cached (None: not) and
        ``new`` were encoded, and store ``new`` (within the bound). A piece that recurs in
        the prompt is encoded once: its other occurrences count as reused."""
        entries = self._entries
        largest = self.max_bytes // _MAX_PIECE_SHARE
        with self._lock:
            stats = self.stats
            stats.prompts += 1
            first = set(new)
            for key, ids in zip(keys, found, strict=True):
                if ids is None and key in first:
                    first.discard(key)
                    stats.pieces_missed += 1
                    stats.tokens_encoded += len(new[key])
                else:
                    stats.pieces_hit += 1
                    stats.tokens_reused += len(new[key] if ids is None else ids)
            for key, ids in new.items():
                size = _entry_bytes(key, ids)
                if key in entries or size > largest:
                    continue
                entries[key] = ids
                self._bytes += size
                self._tokens += len(ids)
            while self._bytes > self.max_bytes:
                old_key, old_ids = entries.popitem(last=False)
                self._bytes -= _entry_bytes(old_key, old_ids)
                self._tokens -= len(old_ids)
                stats.evictions += 1


def _entry_bytes(key: _Key, ids: array[int]) -> int:
    return ENTRY_OVERHEAD_BYTES + sys.getsizeof(key[1]) + ids.itemsize * len(ids)


class _WholeEncoder:
    """Every prompt encoded whole (the cache off, or a tokenizer without clean cuts)."""

    __slots__ = ("_cache", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, cache: PromptCache) -> None:
        self._tokenizer = tokenizer
        self._cache = cache

    def encode(self, text: str, space: str | None = None) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        self._cache._count_whole(len(ids))
        return ids


class _PieceEncoder:
    """Prompts cut at clean cuts, each piece's ids from the cache or encoded (module
    docstring)."""

    __slots__ = ("_boundaries", "_boundary_ids", "_cache", "_sha", "_tokenizer")

    def __init__(
        self, tokenizer: Tokenizer, boundaries: TokenBoundaries, cache: PromptCache
    ) -> None:
        self._tokenizer = tokenizer
        self._boundaries = boundaries
        self._boundary_ids = frozenset(boundaries.ids.values())
        self._cache = cache
        self._sha = tokenizer.sha256

    def encode(self, text: str, space: str | None = None) -> list[int]:
        if not text:
            return self._whole(text)
        ends = self._boundaries.cuts(text)
        if not ends or ends[-1] != len(text):
            ends.append(len(text))
        sha = self._sha if space is None else f"{self._sha}\0{space}"
        keys: list[_Key] = []
        start = 0
        for end in ends:
            keys.append((sha, text[start:end]))
            start = end
        found = self._cache._take(keys)
        new: dict[_Key, array[int]] = {}
        for key, ids in zip(keys, found, strict=True):
            if ids is None:
                new[key] = _EMPTY
        if new and not self._encode_new(new):
            return self._whole(text)
        out: array[int] = array("I")
        for key, ids in zip(keys, found, strict=True):
            out.extend(new[key] if ids is None else ids)
        self._cache._put(keys, found, new)
        return out.tolist()

    def _encode_new(self, new: dict[_Key, array[int]]) -> bool:
        """Fill ``new`` (each piece once, in prompt order) with its pieces' ids, from one
        encode call split at the pieces' ends. False if a split is not where a boundary
        token ends a piece (then nothing is stored and the prompt is encoded whole)."""
        pieces = [key[1] for key in new]
        encoding = self._tokenizer.inner.encode("".join(pieces), add_special_tokens=False)
        all_ids = encoding.ids
        boundary_ids = self._boundary_ids
        char_end = 0
        first = 0
        last_index = len(pieces) - 1
        for i, key in enumerate(new):
            char_end += len(pieces[i])
            if i == last_index:
                end = len(all_ids)
            else:
                # Every piece but the prompt's tail ends with a boundary token: its id.
                token = encoding.char_to_token(char_end - 1)
                if token is None or all_ids[token] not in boundary_ids:
                    return False
                end = token + 1
            new[key] = array("I", all_ids[first:end])
            first = end
        return True

    def _whole(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        self._cache._count_whole(len(ids))
        return ids


_EMPTY: array[int] = array("I")

__all__ = [
    "DEFAULT_MAX_BYTES",
    "PromptCache",
    "PromptCacheStats",
    "PromptEncoder",
]
