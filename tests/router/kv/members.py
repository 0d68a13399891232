"""A KV router's view of its workers for tests: the ids it reads, as the endpoint client
gives them (one tuple until the set changes), and the listeners it registers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from turnout.protocols.model import EndpointId

ENDPOINT = EndpointId(namespace="ns", component="backend", name="generate")


class Members:
    """Live and announced workers ``ids``; ``set_live`` changes them and tells listeners."""

    def __init__(self, ids: list[int]) -> None:
        self.live = tuple(ids)
        self.endpoint = ENDPOINT
        self.listeners: list[Callable[[], None]] = []

    def instance_ids(self) -> tuple[int, ...]:
        return self.live

    def announced_ids(self) -> set[int]:
        return set(self.live)

    def set_live(self, ids: list[int]) -> None:
        self.live = tuple(ids)
        for listener in self.listeners:
            listener()

    def add_listener(self, callback: Callable[[], None]) -> None:
        self.listeners.append(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):  # as the endpoint client: twice is fine
            self.listeners.remove(callback)
