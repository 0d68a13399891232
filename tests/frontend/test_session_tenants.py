"""Sessions are a tenant's own: the same session id from two tenants binds two sessions, so
no tenant can steer its requests to another's worker, or evict another's binding."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from tests.frontend.stack import make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.echo import EchoEngine
from turnout.router.mode import RouterMode

MODEL = "echo"
KEY_A = "sk-turnout-test-session-a-1111"
KEY_B = "sk-turnout-test-session-b-2222"


async def test_the_same_session_id_from_two_tenants_is_two_sessions(
    gguf_path: str, tmp_path: Path
) -> None:
    before = set(asyncio.all_tasks())
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[[keys]]\nkey = "{KEY_A}"\ntenant = "a"\n[[keys]]\nkey = "{KEY_B}"\ntenant = "b"\n'
    )
    stack = await make_stack(
        router_mode=RouterMode.ROUND_ROBIN,
        router_session_affinity_ttl_s=60.0,
        api_keys_file=str(keys),
        public_routes=("/metrics",),
    )
    try:
        for _ in range(2):
            await stack.add_worker(EchoEngine(gguf_path))
        await stack.wait_for_model(MODEL, instances=2)
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            for key in (KEY_A, KEY_B, KEY_A, KEY_B):
                r = await http.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 2},
                    headers={"authorization": f"Bearer {key}", "x-session-id": "shared-id"},
                )
                assert r.status_code == 200, r.text
            metrics = (await http.get("/metrics")).text
        assert f'turnout_session_affinity_sessions{{model="{MODEL}"}} 2.0' in metrics
    finally:
        await stack.close()
    await assert_no_leaked_tasks(before)
