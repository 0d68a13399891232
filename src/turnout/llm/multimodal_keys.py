"""Multimodal cache keys of a chat request, as Dynamo's ``preprocessed_multimodal_cache_keys``:
blake3 hex of each image URL, sorted, de-duplicated. The router uses them to prefer an
instance that already holds a request's images (``router.multimodal_cache``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import blake3

__all__ = ["image_urls", "multimodal_cache_keys"]


def multimodal_cache_keys(urls: Iterable[str]) -> list[str]:
    """blake3 hex of each URL, sorted, de-duplicated (Dynamo's keys)."""
    return sorted({blake3.blake3(url.encode()).hexdigest() for url in urls})


def image_urls(messages: Iterable[Any]) -> list[str]:
    """The URLs of the ``image_url`` content parts of chat messages (objects with a
    ``content`` list of dicts: ``{"type": "image_url", "image_url": {"url": ...}}``, or the
    URL as a plain string)."""
    urls: list[str] = []
    for message in messages:
        content = getattr(message, "content", None)
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if isinstance(url, str) and url:
                urls.append(url)
    return urls
