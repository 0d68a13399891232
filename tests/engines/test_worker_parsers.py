"""The worker announces the parsers it was started with in the card it publishes, whatever
the engine, and refuses names it does not know before anything starts."""

from __future__ import annotations

import pytest
from tests.frontend.stack import echo_engine, make_stack
from tests.polling import eventually

from turnout.engines.mocker import MockerConfig, MockerEngine
from turnout.engines.worker import Worker
from turnout.errors import ConfigError
from turnout.protocols.model import EndpointId
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.discovery.memory import MemoryStore

ENDPOINT = EndpointId(namespace="t", component="backend", name="generate")


@pytest.mark.parametrize(
    ("tool_call_parser", "reasoning_parser"),
    [("hermes", "qwen3"), ("harmony", "harmony"), (None, "deepseek_r1"), (None, None)],
)
async def test_the_card_carries_the_parsers(
    tool_call_parser: str | None, reasoning_parser: str | None
) -> None:
    runtime = await DistributedRuntime.create(store=MemoryStore(), request_plane="tcp")
    engine = MockerEngine(MockerConfig(speedup_ratio=0))
    worker = Worker(
        runtime,
        engine,
        ENDPOINT,
        health_interval=0,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )
    try:
        await worker.start()
        assert worker.card is not None
        caps = worker.card.capabilities
        assert (caps.tool_call_parser, caps.reasoning_parser) == (
            tool_call_parser,
            reasoning_parser,
        )
        # The rest of the engine's capabilities stay as the engine said.
        template = engine.model_card_template().capabilities
        assert caps.structured_outputs == template.structured_outputs
    finally:
        await worker.stop(drain_timeout=0.5)
        await runtime.shutdown()


async def test_an_unknown_name_is_a_config_error_naming_the_known_ones() -> None:
    runtime = await DistributedRuntime.create(store=MemoryStore(), request_plane="tcp")
    try:
        with pytest.raises(ConfigError, match=r"unknown reasoning parser 'qwen4' \(known: .*qwen3"):
            Worker(runtime, MockerEngine(MockerConfig()), ENDPOINT, reasoning_parser="qwen4")
    finally:
        await runtime.shutdown()


async def test_an_instance_with_other_parsers_is_not_served_as_the_same_card(
    gguf_path: str,
) -> None:
    """Two instances of one model whose cards differ only in the tool-call parser: the frontend
    serves the first and holds the second back (its own card, on standby), since its tool
    calls would be read with the wrong parser."""
    stack = await make_stack()
    watcher = stack.frontend.watcher
    assert watcher is not None
    try:
        first = await stack.add_worker(echo_engine(gguf_path), tool_call_parser="hermes")
        await stack.wait_for_model("echo")
        second = await stack.add_worker(echo_engine(gguf_path), tool_call_parser="llama3_json")
        await eventually(
            lambda: any(watcher._models["echo"].standby.values()),
            what="the second card held back on standby",
        )
        assert first.serving is not None and second.serving is not None
        assert stack.frontend.manager.model_instances("echo") == [first.serving.instance_id]
        (served,) = stack.frontend.manager.entries_for_model("echo")
        assert served.capabilities.tool_call_parser == "hermes"
    finally:
        await stack.close()
