"""The preprocessor puts a chat request's multimodal cache keys on the preprocessed request
(Dynamo's ``preprocessed_multimodal_cache_keys``), whatever the template does with images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import blake3
import msgspec

from turnout.llm.model_card import load_model_card
from turnout.llm.preprocessor import Preprocessor
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.model import EndpointId
from turnout.protocols.openai import ChatCompletionRequest

EP = EndpointId(namespace="ns", component="c", name="generate")


class TextOfParts:
    """A template for a model that takes images: renders text parts, skips the images."""

    def render(self, messages: list[dict[str, Any]], **_: Any) -> str:
        out = []
        for m in messages:
            content = m["content"]
            parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
            out += [p["text"] for p in parts if p.get("type") == "text"]
        return "\n".join(out)


def chat(content: Any) -> ChatCompletionRequest:
    body = {"model": "smol", "messages": [{"role": "user", "content": content}]}
    return msgspec.convert(body, ChatCompletionRequest)


async def test_keys_are_blake3_of_the_image_urls_sorted_and_deduplicated(
    gguf_path: Path, smol_tokenizer: Tokenizer
) -> None:
    card = load_model_card(gguf_path, endpoint=EP, context_length=256, display_name="smol")
    pre = Preprocessor(card, smol_tokenizer, TextOfParts())  # type: ignore[arg-type]
    urls = ["https://x/z.png", "https://x/a.png", "https://x/z.png"]
    parts = [{"type": "text", "text": "compare"}] + [
        {"type": "image_url", "image_url": {"url": u}} for u in urls
    ]
    out = await pre.preprocess_chat(chat(parts))
    assert out.multimodal_cache_keys == sorted(
        {blake3.blake3(u.encode()).hexdigest() for u in urls}
    )
    assert len(out.multimodal_cache_keys) == 2
    assert (await pre.preprocess_chat(chat("no images"))).multimodal_cache_keys is None
