"""Model artifacts by content: what a worker publishes so a frontend on another host can
preprocess for its model.

A model card names each artifact (today: the tokenizer's ``tokenizer.json`` bytes) with an
``ArtifactRef`` ``{name, kind, sha256, size}`` and never with a path. The bytes themselves
stay in the worker process, in the process-wide :data:`LOCAL_ARTIFACTS` registry that card
building fills (:func:`publish_artifact`); the worker serves them in chunks of
:data:`CHUNK_SIZE` through its ``artifact`` side handler (``engines.worker``), and the frontend
fetches, verifies and caches them by checksum (``frontend.models.artifacts``).

Layering: protocols and errors only (the request-plane handler lives with the worker).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator

from turnout.errors import TurnoutError
from turnout.protocols.model import ArtifactRef

#: Bytes per response item when an artifact is streamed: well under the request plane's frame
#: limit and NATS's default 1 MiB message limit, whatever the artifact's size.
CHUNK_SIZE = 256 * 1024


class ArtifactError(TurnoutError):
    """An artifact could not be published, served, fetched or verified."""


def make_ref(name: str, kind: str, data: bytes) -> ArtifactRef:
    """The content reference of ``data``."""
    return ArtifactRef(
        name=name, kind=kind, sha256=hashlib.sha256(data).hexdigest(), size=len(data)
    )


class ArtifactRegistry:
    """sha256 -> bytes of the artifacts this process can serve. Thread-safe (cards are built
    off the event loop). Entries live as long as the process: a worker serves its card's
    artifacts for its whole life, and identical bytes (64 mocker workers of one model) are
    held once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blobs: dict[str, bytes] = {}

    def publish(self, name: str, kind: str, data: bytes) -> ArtifactRef:
        """Hold ``data`` for serving; returns its reference."""
        ref = make_ref(name, kind, data)
        with self._lock:
            self._blobs.setdefault(ref.sha256, data)
        return ref

    def get(self, sha256: str) -> bytes | None:
        with self._lock:
            return self._blobs.get(sha256)

    def __contains__(self, sha256: object) -> bool:
        with self._lock:
            return sha256 in self._blobs

    def discard(self, sha256: str) -> None:
        """Forget one artifact (tests that simulate a worker that lost its bytes)."""
        with self._lock:
            self._blobs.pop(sha256, None)


#: The artifacts of the cards built in this process (``load_model_card`` publishes here).
LOCAL_ARTIFACTS = ArtifactRegistry()


def publish_artifact(name: str, kind: str, data: bytes) -> ArtifactRef:
    """Publish ``data`` in :data:`LOCAL_ARTIFACTS` and return its reference."""
    return LOCAL_ARTIFACTS.publish(name, kind, data)


def iter_chunks(data: bytes, size: int = CHUNK_SIZE) -> Iterator[bytes]:
    """``data`` cut into pieces of at most ``size`` bytes (none for empty data), copied one
    at a time as they are sent."""
    view = memoryview(data)
    for i in range(0, len(data), size):
        yield bytes(view[i : i + size])


__all__ = [
    "CHUNK_SIZE",
    "LOCAL_ARTIFACTS",
    "ArtifactError",
    "ArtifactRegistry",
    "iter_chunks",
    "make_ref",
    "publish_artifact",
]
