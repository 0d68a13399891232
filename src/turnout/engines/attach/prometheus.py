"""Read the few series attach needs out of a server's Prometheus text (``GET /metrics``).

Not a full exposition-format parser: one pass over the lines, keeping only the wanted names,
with their labels parsed only when asked. Values of one name are summed over its label sets
(vLLM labels each data-parallel engine, SGLang each tensor-parallel rank).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

__all__ = ["Samples", "parse_samples"]

_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Samples:
    """The samples of the wanted series: ``name -> [(labels text, value)]``."""

    __slots__ = ("_series",)

    def __init__(self, series: dict[str, list[tuple[str, float]]]) -> None:
        self._series = series

    def __contains__(self, name: object) -> bool:
        return name in self._series

    def total(self, *names: str) -> float | None:
        """The sum over the label sets of the first of ``names`` present (None: none is)."""
        for name in names:
            values = self._series.get(name)
            if values:
                return math.fsum(v for _, v in values)
        return None

    def mean(self, *names: str) -> float | None:
        for name in names:
            values = self._series.get(name)
            if values:
                return math.fsum(v for _, v in values) / len(values)
        return None

    def labels(self, name: str) -> list[dict[str, str]]:
        """The label sets of ``name``'s samples (``cache_config_info`` carries its values
        there)."""
        return [dict(_LABEL.findall(text)) for text, _ in self._series.get(name, [])]


def parse_samples(text: str, names: Iterable[str]) -> Samples:
    """The samples of ``names`` in ``text``; malformed lines are skipped."""
    wanted = set(names)
    series: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        if 0 <= brace < space:
            name = line[:brace]
            end = line.rfind("}")
            if end < brace:
                continue
            labels, rest = line[brace + 1 : end], line[end + 1 :]
        else:
            name, labels, rest = line[:space], "", line[space:]
        if name not in wanted:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(value):
            series.setdefault(name, []).append((labels, value))
    return Samples(series)
