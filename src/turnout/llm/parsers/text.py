"""Scanning helpers shared by the parsers: markers that may arrive split across deltas."""

from __future__ import annotations

import os


def new_call_id() -> str:
    """A tool call's id, in OpenAI's shape (``call_`` and 24 hex digits)."""
    return "call_" + os.urandom(12).hex()


def hold_partial(buf: str, markers: tuple[str, ...]) -> int:
    """Where the longest tail of ``buf`` that could start one of ``markers`` begins (the
    text from there must be held until the next delta says); ``len(buf)`` when none."""
    cut = len(buf)
    for marker in markers:
        first = marker[0]
        # Only the last len(marker) - 1 characters can hold a proper prefix.
        start = max(len(buf) - len(marker) + 1, 0)
        i = buf.find(first, start)
        while i != -1:
            if marker.startswith(buf[i:]):
                cut = min(cut, i)
                break
            i = buf.find(first, i + 1)
    return cut


def find_first(buf: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The earliest of ``markers`` in ``buf``: (index, marker), or (-1, "")."""
    best, found = -1, ""
    for marker in markers:
        i = buf.find(marker)
        if i != -1 and (best == -1 or i < best):
            best, found = i, marker
    return best, found
