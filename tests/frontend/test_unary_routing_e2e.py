"""Embedding and tensor requests are routed like generation requests: router modes, a pin
to one instance (``nvext.backend_instance_id``), 404 for an instance nobody knows."""

from __future__ import annotations

import httpx
import pytest
from tests.frontend.stack import make_stack

from turnout.engines.tensor import NumericEngine
from turnout.router.mode import RouterMode

X = {"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1]}


class CountingNumeric(NumericEngine):
    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def compute(self, inputs: dict[str, object]) -> dict[str, object]:  # type: ignore[override]
        self.runs += 1
        return super().compute(inputs)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", [RouterMode.ROUND_ROBIN, RouterMode.LEAST_LOADED])
async def test_requests_spread_over_instances(mode: RouterMode) -> None:
    stack = await make_stack(router_mode=mode)
    engines = [CountingNumeric(), CountingNumeric()]
    try:
        for engine in engines:
            await stack.add_worker(engine, model_name="numeric")
        await stack.wait_for_model("numeric", instances=2)
        async with httpx.AsyncClient(base_url=stack.url) as http:
            for _ in range(6):
                r = await http.post("/v1/tensor", json={"model": "numeric", "inputs": [X]})
                assert r.status_code == 200
        assert sum(e.runs for e in engines) == 6
        if mode is RouterMode.ROUND_ROBIN:
            assert [e.runs for e in engines] == [3, 3]
    finally:
        await stack.close()


async def test_direct_mode_pins_and_names_a_missing_pin() -> None:
    stack = await make_stack(router_mode=RouterMode.DIRECT)
    engines = [CountingNumeric(), CountingNumeric()]
    try:
        workers = [await stack.add_worker(e, model_name="numeric") for e in engines]
        await stack.wait_for_model("numeric", instances=2)
        target = workers[1].serving
        assert target is not None
        async with httpx.AsyncClient(base_url=stack.url) as http:
            body = {"model": "numeric", "inputs": [X]}
            r = await http.post("/v1/tensor", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == (
                "nvext.backend_instance_id"
            )
            pinned = {**body, "nvext": {"backend_instance_id": target.instance_id}}
            for _ in range(3):
                assert (await http.post("/v1/tensor", json=pinned)).status_code == 200
            assert [e.runs for e in engines] == [0, 3]
            unknown = {**body, "nvext": {"backend_instance_id": 12345}}
            r = await http.post("/v1/tensor", json=unknown)
            assert r.status_code == 404 and r.json()["error"]["code"] == "instance_not_found"
    finally:
        await stack.close()
