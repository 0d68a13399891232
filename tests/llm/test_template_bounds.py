"""Chat templates run on a budget: whatever a template does, a render stops quickly and small.

Real templates (SmolLM2's own, and ones shaped like Qwen2.5's and Llama 3.1's) render exactly
as jinja2's plain sandbox renders them, and a long conversation stays well within its budget.
Hostile templates (loops that do not end, values that double, padding to a gigabyte, ...)
stop with ``TemplateLimitExceeded`` within a fraction of a second, having built little.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tests.llm.templates import LLAMA_LIKE, QWEN_LIKE, WEATHER_TOOL, conversation

from turnout.errors import ConfigError, RequestError, TemplateLimitExceeded
from turnout.llm.chat_template import ChatTemplate, TemplateLimits, render_budget
from turnout.llm.gguf_tokenizer import read_gguf_metadata

#: A render of a hostile template must stop within this (the budget allows ~0.25 s of the
#: slowest operations; the rest is slack for a loaded machine).
QUICK = 2.0


def reference(source: str, messages: list[dict[str, Any]], **context: Any) -> str:
    """What jinja2's plain immutable sandbox renders (HF's settings), for comparison."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(ValueError(m))
    return env.from_string(source).render(messages=messages, **context)


@pytest.fixture(scope="module")
def smol_source(gguf_path: Path) -> str:
    return str(read_gguf_metadata(gguf_path)["tokenizer.chat_template"])


def _without_none(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as ``normalize_messages`` hands them to templates (None fields left out)."""
    return [
        {k: ("" if v is None and k == "content" and "tool_calls" not in m else v)
         for k, v in m.items() if v is not None or (k == "content" and "tool_calls" not in m)}
        for m in messages
    ]  # fmt: skip


@pytest.mark.parametrize("turns", [1, 20])
@pytest.mark.parametrize("name", ["smollm2", "qwen", "llama"])
def test_real_templates_render_as_the_plain_sandbox_does(
    smol_source: str, name: str, turns: int
) -> None:
    source, tools, tokens = {
        "smollm2": (smol_source, None, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}),
        "qwen": (QWEN_LIKE, [WEATHER_TOOL], {"bos_token": "", "eos_token": ""}),
        "llama": (LLAMA_LIKE, [WEATHER_TOOL], {"bos_token": "<s>", "eos_token": ""}),
    }[name]
    messages = conversation(turns)
    if name == "smollm2":  # text only: keep user and answer turns
        messages = [m for m in messages if m["role"] != "tool" and m.get("content")]
    template = ChatTemplate(source, tokens["bos_token"], tokens["eos_token"])
    expected = reference(
        source, _without_none(messages), tools=tools, add_generation_prompt=True, **tokens
    )
    assert template.render(messages, tools=tools) == expected
    template.probe()  # real templates pass the probe


def test_a_long_conversation_stays_within_its_budget() -> None:
    """10,000 messages (``--max-messages``) with tools, through the heaviest real-shaped
    template: well inside the budget that size of request gets."""
    messages = conversation(2500)
    text = ChatTemplate(QWEN_LIKE).render(messages, tools=[WEATHER_TOOL])
    assert text.count("<tool_response>") == 2500


SPIN = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"

HOSTILE: list[tuple[str, str, str]] = [
    ("nested loops", SPIN, "operation budget"),
    ("loop over a range too large", "{% for i in range(10**9) %}x{% endfor %}", "out of bounds"),
    ("repeat", "{{ 'x' * 10**9 }}", "repeated value of 1000000000"),
    ("repeat a list", "{{ (['x' * 100000] * 100000)|length }}", "repeated value"),
    ("centre", "{{ 'x'|center(1000000000) }}", "centred string"),
    ("pad", "{{ 'x'.ljust(1000000000) }}", "padded string"),
    (
        "double with ~",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "concatenated string",
    ),
    (
        "double with +",
        "{% set ns = namespace(s=['x']) %}{% for i in range(64) %}"
        "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
        "concatenated value",
    ),
    ("power", "{{ 7 ** (10 ** 7) }}", "number too large"),
    ("printf width", "{{ '%1000000000d' % 1 }}", "formatted field"),
    ("format width", "{{ '{:>1000000000}'.format(1) }}", "formatted field"),
    ("format filter", "{{ '%1000000000d'|format(1) }}", "formatted field"),
    ("replace", "{% set s = 'x' * 100000 %}{{ s.replace('', s) }}", "replaced string"),
    ("indent", "{{ ('x\\n' * 100000)|indent(100000) }}", "indented string"),
    ("join", "{{ (['x' * 1000] * 1000)|join('y' * 100000) }}", "joined string"),
    (
        "macro doubling",
        "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
        "operation budget",
    ),
    ("macro recursion", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recurses"),
    ("recursive loop", "{% for x in [1, 2] recursive %}{{ loop([1, 2]) }}{% endfor %}", "recurses"),
    ("output", "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "writes more"),
    (
        "membership in a loop",
        "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{% if 'y' in s %}{% endif %}"
        "{% endfor %}",
        "operation budget",
    ),
    (
        "slices in a loop",
        "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{% set t = s[1:] %}{% endfor %}",
        "operation budget",
    ),
    (
        "filters in a loop",
        "{% for i in range(300) %}{% for j in range(300) %}"
        "{{ (messages|selectattr('role')|list)|length }}{% endfor %}{% endfor %}",
        "operation budget",
    ),
    ("sum of lists", "{{ range(100000)|batch(1)|sum(start=[]) }}", "sums non-numbers"),
    ("strftime", "{{ strftime_now('%c' * 1000) }}", "strftime format"),
    ("map to a filter", "{{ range(10)|map('center', 10000000)|join }}", "centred string"),
]


@pytest.mark.parametrize(
    ("source", "why"), [(s, w) for _, s, w in HOSTILE], ids=[i for i, _, _ in HOSTILE]
)
def test_a_hostile_template_stops_quickly(source: str, why: str) -> None:
    template = ChatTemplate(source)
    started = time.monotonic()
    with pytest.raises(TemplateLimitExceeded, match=why):
        template.render([{"role": "user", "content": "hello"}])
    took = time.monotonic() - started
    assert took < QUICK, f"{took:.2f}s"


def test_the_probe_refuses_a_template_that_spins_on_any_input() -> None:
    started = time.monotonic()
    with pytest.raises(TemplateLimitExceeded):
        ChatTemplate(SPIN).probe()
    assert time.monotonic() - started < QUICK


def test_the_probe_passes_templates_that_refuse_its_conversation() -> None:
    """A template may reject system messages or tools: that is the request's business."""
    picky = (
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('no system messages') }}{% endif %}{{ m.content }}{% endfor %}"
    )
    ChatTemplate(picky).probe()
    with pytest.raises(RequestError, match="no system messages"):
        ChatTemplate(picky).render([{"role": "system", "content": "x"}])


def test_a_template_that_does_not_compile_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_the_budget_grows_with_the_request() -> None:
    limits = TemplateLimits()
    small = render_budget(1, 10)
    large = render_budget(10_000, 16 << 20)
    assert small.ops == limits.ops_base + limits.ops_per_item
    assert large.ops > 10 * small.ops
    assert large.max_value_chars >= 4 * (16 << 20)
    # A template that writes its input once and a little per message never comes close.
    assert small.max_value_chars >= limits.output_base_chars


def test_renders_in_threads_have_their_own_budgets() -> None:
    """A render offloaded to a thread (long prompts) spends its own budget, not another's."""
    template = ChatTemplate(QWEN_LIKE)
    hostile = ChatTemplate(SPIN)
    results: list[str] = []
    errors: list[BaseException] = []

    def legit() -> None:
        for _ in range(20):
            results.append(template.render(conversation(5), tools=[WEATHER_TOOL]))

    def spin() -> None:
        for _ in range(20):
            try:
                hostile.render([{"role": "user", "content": "x"}])
            except TemplateLimitExceeded as e:
                errors.append(e)

    threads = [threading.Thread(target=legit), threading.Thread(target=spin)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 20 and len(set(results)) == 1
    assert len(errors) == 20
