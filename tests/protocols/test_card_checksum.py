"""A card's checksum covers what the engine can do: two instances whose cards differ only in
their capabilities (a parser, structured outputs, log probabilities) are two cards, never one
model served by both, since the frontend checks requests and parses output by the served
card's capabilities. What may differ between instances of one card (its endpoint, its
instance id, the order an engine lists its structured-output kinds in) leaves it alone."""

from __future__ import annotations

import msgspec
import pytest

from turnout.protocols.model import (
    EndpointId,
    ModelCapabilities,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
)

EP = EndpointId(namespace="t", component="backend", name="generate")
BASE = ModelCapabilities(
    logprobs=True,
    max_top_logprobs=5,
    structured_outputs=["json_object", "regex"],
    tool_call_parser="hermes",
)


def card(caps: ModelCapabilities = BASE, **fields: object) -> ModelDeploymentCard:
    base = ModelDeploymentCard(
        display_name="m",
        endpoint=EP,
        instance_id=1,
        model_type=ModelType.Chat,
        model_input=ModelInput.Tokens,
        capabilities=caps,
    )
    return msgspec.structs.replace(base, **fields)


@pytest.mark.parametrize(
    "change",
    [
        {"logprobs": False},
        {"max_top_logprobs": 20},
        {"min_tokens": True},
        {"structured_outputs": ["json_object"]},
        {"structured_outputs": ["json_object", "regex", "grammar"]},
        {"tool_call_parser": None},
        {"tool_call_parser": "llama3_json"},
        {"reasoning_parser": "qwen3"},
    ],
)
def test_cards_differing_only_in_a_capability_differ_in_checksum(change: dict[str, object]) -> None:
    other = msgspec.structs.replace(BASE, **change)
    assert card(other).checksum() != card().checksum()


def test_every_capability_field_is_covered() -> None:
    """A field added to ``ModelCapabilities`` joins the checksum without a code change."""
    changed = {
        bool: lambda v: not v,
        int: lambda v: v + 1,
        list: lambda v: [*v, "new"],
        str: lambda v: (v or "") + "x",
        type(None): lambda v: "x",
    }
    for name in BASE.__struct_fields__:
        value = getattr(BASE, name)
        other = msgspec.structs.replace(BASE, **{name: changed[type(value)](value)})
        assert card(other).checksum() != card().checksum(), name


def test_what_instances_of_one_card_may_differ_in_leaves_it_alone() -> None:
    reordered = msgspec.structs.replace(BASE, structured_outputs=["regex", "json_object"])
    other_ep = EndpointId(namespace="u", component="backend", name="generate")
    assert card(reordered).checksum() == card().checksum()
    assert card(instance_id=2, endpoint=other_ep).checksum() == card().checksum()
