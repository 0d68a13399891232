"""The model a mocker-server pretends to serve: its name, tokenizer, chat template and limits.

The tokens are the mocker's, but the text around them is a real model's: prompts are encoded
with the model's own tokenizer (read from the GGUF file's metadata, or an HF directory's
``tokenizer.json``, through ``llm.model_card``), chat messages go through its own template,
and output ids are decoded with the same tokenizer, so a router that tokenizes on its side
(vLLM's, SGLang's gateway, turnout's tokens mode) sees the ids it computed itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from turnout.errors import ConfigError
from turnout.llm.artifacts import LOCAL_ARTIFACTS
from turnout.llm.chat_template import ChatTemplate
from turnout.llm.tokenizer import Tokenizer, load_tokenizer
from turnout.protocols.model import EndpointId

#: The endpoint a card needs; the mocker-server registers nowhere.
_NO_ENDPOINT = EndpointId(namespace="mocker-server", component="engine", name="generate")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServedModel:
    """What the HTTP faces need to know about the model. Read-only after loading."""

    #: The name clients put in ``"model"`` (``--served-model-name``, else the model's own).
    name: str
    #: The model file or directory (``root`` in ``/v1/models``, ``model_path`` in SGLang's).
    path: str
    tokenizer: Tokenizer
    #: None when the model has none: chat routes then answer 400.
    chat_template: ChatTemplate | None
    #: Longest prompt + output a request may have: the model's context, cut to what the
    #: simulated KV pool can hold.
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def load_served_model(
    model_path: str | Path | None,
    *,
    served_model_name: str | None = None,
    max_model_len: int | None = None,
    max_pool_tokens: int,
) -> ServedModel:
    """Read the model at ``model_path`` (default: the SmolLM2 GGUF). Blocking: run it off the
    event loop. ``ConfigError`` when the model cannot be read or has no tokenizer."""
    from turnout.llm import model_card

    path = Path(model_path) if model_path else model_card.default_gguf_path()
    card = model_card.load_model_card(path, endpoint=_NO_ENDPOINT, context_length=max_model_len)
    ref = card.tokenizer
    data = LOCAL_ARTIFACTS.get(ref.sha256) if ref is not None else None
    if ref is None or data is None:
        raise ConfigError(f"{path}: the model has no tokenizer the mocker-server can use")
    tokenizer = load_tokenizer(ref, data, bos_token=card.bos_token, eos_token=card.eos_token)
    template = None
    if card.chat_template:
        template = ChatTemplate(card.chat_template, card.bos_token, card.eos_token)
    eos = tuple(card.eos_token_ids) or (
        (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    )
    return ServedModel(
        name=served_model_name or card.display_name,
        path=str(path),
        tokenizer=tokenizer,
        chat_template=template,
        max_model_len=min(card.context_length, max_pool_tokens),
        eos_token_ids=eos,
    )
