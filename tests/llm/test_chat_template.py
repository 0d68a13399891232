"""Chat templates render like transformers' apply_chat_template."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from turnout.errors import ConfigError, RequestError
from turnout.llm.chat_template import ChatTemplate
from turnout.llm.gguf_tokenizer import read_gguf_metadata

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def smol_template(gguf_path: Path) -> ChatTemplate:
    source = read_gguf_metadata(gguf_path)["tokenizer.chat_template"]
    return ChatTemplate(source, bos_token="<|im_start|>", eos_token="<|im_end|>")


def test_smollm2_template(smol_template: ChatTemplate) -> None:
    text = smol_template.render([{"role": "user", "content": "Hi there"}])
    assert text == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_template_with_system_no_generation_prompt(smol_template: ChatTemplate) -> None:
    text = smol_template.render(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ],
        add_generation_prompt=False,
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )


def test_content_parts_are_concatenated(smol_template: ChatTemplate) -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    text = smol_template.render(
        [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]
    )
    assert "<|im_start|>user\nHello, world<|im_end|>" in text


def test_non_text_part_is_rejected(smol_template: ChatTemplate) -> None:
    parts = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(RequestError, match="'image_url'") as info:
        smol_template.render([{"role": "user", "content": parts}])
    assert info.value.param == "messages.[0].content"


def test_null_content_becomes_empty(smol_template: ChatTemplate) -> None:
    text = smol_template.render([{"role": "system", "content": None}], add_generation_prompt=False)
    assert text == "<|im_start|>system\n<|im_end|>\n"


RAISING = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{{ m['content'] }}{% endfor %}"
)


def test_raise_exception_is_a_request_error() -> None:
    t = ChatTemplate(RAISING)
    assert t.render([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(RequestError, match=r"^Only user and assistant roles are supported!$"):
        t.render([{"role": "system", "content": "nope"}])


def test_runtime_errors_are_request_errors() -> None:
    t = ChatTemplate("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(RequestError, match="chat template error") as info:
        t.render([{"role": "user", "content": "x"}])
    assert info.value.param == "messages"


def test_sandbox_blocks_python_internals() -> None:
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(RequestError):
        t.render([{"role": "user", "content": "x"}])
    mutating = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(RequestError):
        mutating.render([{"role": "user", "content": "x"}])


def test_syntax_error_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_tojson_like_hf() -> None:
    t = ChatTemplate("{{ tools | tojson }}|{{ tools | tojson(indent=2) }}")
    tools = [{"name": "天气", "args": {"a": 1}}]
    out = t.render([], tools=tools)
    compact, indented = out.split("|", 1)
    assert compact == '[{"name": "天气", "args": {"a": 1}}]'  # no \\u escapes, no HTML escaping
    assert indented.startswith('[\n  {\n    "name": "天气"')


def test_globals_and_kwargs() -> None:
    t = ChatTemplate(
        "{{ bos_token }}{{ strftime_now('%Y') }}{% if enable_thinking %}T{% endif %}{{ eos_token }}"
    )
    year = str(datetime.datetime.now().year)
    assert t.render([], enable_thinking=True) == f"{year}T"  # no bos/eos given: empty
    t2 = ChatTemplate(t.source, bos_token="<s>", eos_token="</s>")
    assert t2.render([], enable_thinking=False) == f"<s>{year}</s>"


def test_trim_and_lstrip_blocks() -> None:
    source = (
        "{% for m in messages %}\n    {% if true %}\n[{{ m['content'] }}]\n"
        "    {% endif %}\n{% endfor %}"
    )
    assert ChatTemplate(source).render([{"role": "u", "content": "a"}]) == "[a]\n"
