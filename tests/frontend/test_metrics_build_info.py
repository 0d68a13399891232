"""The frontend's ``/metrics`` carries the process's own metrics and the build line, as the
workers' system endpoint does (``component="frontend"``), over a real HTTP server."""

from __future__ import annotations

import httpx
from tests.cli.test_system_port import assert_build_and_process
from tests.frontend.stack import make_stack


async def test_frontend_metrics_hold_the_build_and_the_process() -> None:
    stack = await make_stack()
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as http:
            metrics = await http.get("/metrics")
        assert metrics.status_code == 200
        assert_build_and_process(metrics.text, "frontend")
    finally:
        await stack.close()
