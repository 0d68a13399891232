"""Which llama.cpp slot runs a request, so that a cache partition (``cache_salt``) never reuses
another partition's prompt cache.

llama.cpp keeps, in each slot, the KV of the last prompt it ran there, and reuses its common
prefix with the next prompt on that slot (``cache_prompt``). Left to itself, llama.cpp picks
the slot by prompt similarity over *all* slots, and (with its RAM prompt cache) saves idle
slots' prompts and restores the best match into any slot: a tenant would be served, and could
time, another tenant's cached prefix. So the engine picks the slot itself and pins it
(``id_slot``), with the RAM prompt cache off (``cache_ram_mib = 0``, which also stops the
clearing of idle slots that would empty a pinned slot's cache whenever another slot starts).

Each slot has a record: busy or not, the partition its KV belongs to, the token ids of its
last prompt, and when it was last taken. A request takes (``choose_slot``):

* the free slot of its own partition with the longest common prefix with its prompt (what
  llama.cpp's similarity choice does, within the partition), with ``cache_prompt`` on;
* else the least recently used free slot, with ``cache_prompt`` on only when that slot is of
  its partition already: on another partition's slot llama.cpp recomputes the whole prompt
  and overwrites the slot's KV.

Unsalted requests (``None``) are a partition of their own. Only the request's own partition's
prompts are compared with its prompt, so which slot it gets, and how long its prefill takes,
depends on other partitions' requests only through how many slots they hold and when they took
them, never through what their prompts are.

Measured on xllamacpp (SmolLM2, two slots, kv_unified): a pinned slot run with ``cache_prompt``
off keeps the new prompt's KV (the next same-prompt request on it with ``cache_prompt`` on
reports ``cache_n`` = prompt - 1); with the RAM prompt cache on (llama.cpp's default), starting
a task on one slot emptied the other idle slot (``cache_n`` 0), and an unpinned request got the
emptied slot's prompt back from the RAM cache.

A slot becomes the request's partition once llama.cpp processed the prompt (the request saw a
chunk). A request that ends before that (refused, cancelled while waiting for its prefill)
leaves the slot's KV in a state we do not know: unless the slot was of its partition already,
the slot then belongs to no partition, and its next request recomputes its prompt.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final


class _Unknown:
    """The partition of a slot whose KV no partition may reuse (never run, or left by a
    request that ended before its prompt was processed)."""

    def __repr__(self) -> str:
        return "UNKNOWN"


#: The partition of a slot whose KV no request may reuse: equal to no request's salt.
UNKNOWN: Final = _Unknown()


@dataclass(slots=True)
class SlotRecord:
    """What the engine knows of one llama.cpp slot."""

    busy: bool = False
    #: The ``cache_salt`` its KV belongs to (None: unsalted requests; ``UNKNOWN``: none).
    salt: str | _Unknown | None = UNKNOWN
    #: The token ids of its last prompt (what its KV holds, before the generated tokens).
    tokens: Sequence[int] = ()
    #: The ``SlotTable`` tick when it was last taken (-1: never): the least recent goes first.
    last_used: int = -1


@dataclass(frozen=True, slots=True)
class Claim:
    """A slot taken for one request: pin it (``id_slot``), and reuse its cached prefix only
    when ``reuse``."""

    slot: int
    reuse: bool
    salt: str | None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of two token id sequences (a binary search over slice
    comparisons, which run in C: a few slices per call instead of a Python loop per token)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def choose_slot(slots: Sequence[SlotRecord], salt: str | None, tokens: Sequence[int]) -> Claim:
    """The slot a request of partition ``salt`` with prompt ``tokens`` takes (see the module
    docstring). Raises ``LookupError`` when every slot is busy."""
    best, best_prefix = -1, 0
    lru = -1
    for i, slot in enumerate(slots):
        if slot.busy:
            continue
        if lru < 0 or slot.last_used < slots[lru].last_used:
            lru = i
        if slot.salt == salt:
            prefix = common_prefix(slot.tokens, tokens)
            if prefix > best_prefix:
                best, best_prefix = i, prefix
    if best >= 0:
        return Claim(slot=best, reuse=True, salt=salt)
    if lru < 0:
        raise LookupError("every llama.cpp slot is busy")
    return Claim(slot=lru, reuse=slots[lru].salt == salt, salt=salt)


class SlotTable:
    """The records of llama.cpp's ``n_slots`` slots, taken and given back from pool threads.

    The engine runs at most ``n_slots`` requests at once (one pool thread each, holding at
    most one slot), so a request that starts always finds a free slot. A slot is given back
    when its request's last output is decided, a moment before llama.cpp frees it (right
    after its last chunk, or at the cancel the callback's True sends): a task pinned to it in
    that moment waits in llama.cpp's queue until it does, and never shares it."""

    def __init__(self, n_slots: int) -> None:
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        self._lock = threading.Lock()
        self._slots = [SlotRecord() for _ in range(n_slots)]
        self._tick = 0

    def acquire(self, salt: str | None, tokens: Sequence[int]) -> Claim:
        """Take a free slot for a request (``choose_slot``); ``LookupError`` when none is."""
        with self._lock:
            claim = choose_slot(self._slots, salt, tokens)
            slot = self._slots[claim.slot]
            slot.busy = True
            slot.last_used = self._tick
            self._tick += 1
            return claim

    def release(self, claim: Claim, tokens: Sequence[int], *, prompt_processed: bool) -> None:
        """Give a slot back. With ``prompt_processed`` its KV holds ``tokens`` (and what was
        generated after them) and belongs to the claim's partition; without, it stays as it
        was when the claim reused it, and belongs to no partition otherwise."""
        with self._lock:
            slot = self._slots[claim.slot]
            slot.busy = False
            if prompt_processed:
                slot.salt, slot.tokens = claim.salt, tokens
            elif not claim.reuse:
                slot.salt, slot.tokens = UNKNOWN, ()

    def snapshot(self) -> list[SlotRecord]:
        """A copy of the records (for tests and diagnostics)."""
        with self._lock:
            return [
                SlotRecord(busy=s.busy, salt=s.salt, tokens=s.tokens, last_used=s.last_used)
                for s in self._slots
            ]
