"""A scripted agent engine: a model that calls a tool twice, then answers from the results.

It reads the conversation the frontend rendered (``TEMPLATE``: one line a message,
``role: content``, a tool result's ``tool_call_id`` after its role, an assistant's tool calls
as JSON after its text; content written as it is, so a null would show as ``None``) and
answers as a tool-calling model would, in hermes markup:

* no tool result yet: a call of ``get_weather`` for Paris;
* one result: a call for Rome, but only if the first turn came back whole (the assistant's
  call replayed with its arguments as an object, its result under the call's id): else it
  answers with what it missed, which the tests see;
* two results: the final answer, ``Paris: <first result>. Rome: <second result>.``

So an agent loop ends with that answer only when each of its turns round-trips through the
framework's own serializer and turnout's template.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import msgspec

from turnout.engines.echo import EchoEngine
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.llm import CompletionUsage, FinishReason, LLMEngineOutput
from turnout.protocols.llm import PreprocessedRequest as Request
from turnout.protocols.model import ModelDeploymentCard
from turnout.runtime.context import RequestContext

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}{% if m.tool_call_id %}[{{ m.tool_call_id }}]"
    "{% endif %}: {{ m['content'] }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
    "{{ '\\n' }}{% endfor %}{{ eos_token }}"
)

CITIES = ("Paris", "Rome")
TOOL = "get_weather"
#: A tool result line as ``TEMPLATE`` writes it: its call's id, its text.
_RESULT = re.compile(r"^tool\[([^\]]+)\]: (.*)$", re.MULTILINE)


def call_markup(city: str) -> str:
    arguments = json.dumps({"city": city})
    return f'<tool_call>\n{{"name": "{TOOL}", "arguments": {arguments}}}\n</tool_call>'


def final_answer(results: list[str]) -> str:
    return " ".join(f"{city}: {result}." for city, result in zip(CITIES, results, strict=True))


def answer(prompt: str) -> str:
    """What the scripted model says after ``prompt``."""
    results = _RESULT.findall(prompt)
    if not results:
        return call_markup(CITIES[0])
    calls = _replayed_calls(prompt)
    for (call_id, _), city in zip(results, CITIES, strict=False):
        replayed = {"name": TOOL, "arguments": {"city": city}}
        if calls.get(call_id) != replayed or "None" in prompt:
            return f"MISSED the replayed call {call_id} (prompt: {prompt!r})"
    if len(results) == 1:
        return call_markup(CITIES[1])
    return final_answer([text for _, text in results[:2]])


def _replayed_calls(prompt: str) -> dict[str, object]:
    """The function of every call the assistant lines of ``prompt`` replay, by call id."""
    calls: dict[str, object] = {}
    for line in prompt.splitlines():
        start = line.find("[{")
        if line.startswith("assistant: ") and start >= 0:
            for call in json.loads(line[start:]):
                calls[call["id"]] = call["function"]
    return calls


class ScriptedToolEngine(EchoEngine):
    """Answers with ``answer(prompt)`` (see the module docstring); records every prompt."""

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        self._tokenizer = Tokenizer.from_gguf(model_path)
        #: The rendered prompt of every request, in order.
        self.prompts: list[str] = []

    def model_card_template(self) -> ModelDeploymentCard:
        return msgspec.structs.replace(super().model_card_template(), chat_template=TEMPLATE)

    async def generate(
        self, request: Request, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        prompt = self._tokenizer.decode(request.token_ids, skip_special_tokens=False)
        self.prompts.append(prompt)
        ids = self._tokenizer.encode(answer(prompt))
        usage = CompletionUsage(
            prompt_tokens=len(request.token_ids), completion_tokens=len(ids), cached_tokens=0
        )
        for token in ids[:-1]:
            yield LLMEngineOutput(token_ids=[token])
        yield LLMEngineOutput(token_ids=ids[-1:], finish_reason=FinishReason.EOS, usage=usage)
