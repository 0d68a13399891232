"""Frontend tests keep their fetched artifacts in a temporary cache, not ``~/.cache``."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from turnout.frontend.artifacts import CACHE_ENV


@pytest.fixture(scope="session", autouse=True)
def _artifact_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("artifact_cache"))
    yield
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before
