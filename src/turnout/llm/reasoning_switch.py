"""A request's reasoning effort, as the model's chat template takes it.

A model reasons as its template tells it to, and templates spell the switch their own way:

* gpt-oss's (harmony) writes ``Reasoning: {{ reasoning_effort }}`` into its system message:
  ``low``, ``medium`` or ``high``, the three levels the model was trained on (any other is
  refused).
* Qwen3's, and the templates built like it, take ``enable_thinking``: effort ``none`` turns
  reasoning off, any other turns it on (as vLLM sets it: there is no finer level).
* A model that does not reason (its card names no reasoning parser) reasons at ``none``
  already.

Anything else cannot be honoured, and is a 400 naming the field: a template with no switch
(a reasoning model that always reasons, or any model asked to reason harder than it does).
The switch is read from the template's source, as the Anthropic surface reads
``enable_thinking``: a template that never names the variable never reads it.
"""

from __future__ import annotations

from typing import Any

from turnout.errors import RequestError
from turnout.protocols.model import ModelDeploymentCard

#: OpenAI's effort levels, and Anthropic's ``max``.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
#: The levels gpt-oss's harmony format names.
HARMONY_EFFORTS = ("low", "medium", "high")


def reasoning_switch(card: ModelDeploymentCard, effort: str, param: str) -> dict[str, Any]:
    """The template variables that set ``effort`` on the model of ``card`` (empty when its
    model reasons at that effort anyway); a 400 naming ``param`` when they cannot."""
    if effort not in EFFORTS:
        raise RequestError(
            f"'{param}' must be one of {', '.join(EFFORTS)}, got {effort!r}", param=param
        )
    template = card.chat_template or ""
    model = card.display_name
    if "reasoning_effort" in template:
        if effort not in HARMONY_EFFORTS:
            raise RequestError(
                f"model '{model}' takes a reasoning effort of {', '.join(HARMONY_EFFORTS)} "
                f"(its chat template's levels), not {effort!r}",
                param=param,
            )
        return {"reasoning_effort": effort}
    if "enable_thinking" in template:
        return {"enable_thinking": effort != "none"}
    if effort == "none" and card.capabilities.reasoning_parser is None:
        return {}
    raise RequestError(
        f"model '{model}' has no reasoning switch in its chat template (neither "
        f"'reasoning_effort' nor 'enable_thinking'), so a reasoning effort of {effort!r} "
        "cannot be honoured",
        param=param,
    )


__all__ = ["EFFORTS", "HARMONY_EFFORTS", "reasoning_switch"]
