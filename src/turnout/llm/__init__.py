"""LLM pre- and post-processing: tokenizers, model cards, chat templates, the preprocessor
(OpenAI request -> token ids) and the backend (token stream -> text with stop semantics).

Layering: uses ``turnout.protocols`` and ``turnout.errors`` only.
"""

from .backend import Backend, DecodedDelta, StreamDecoder
from .chat_template import ChatTemplate
from .detokenizer import Detokenizer
from .model_card import default_gguf_path, load_model_card
from .preprocessor import Preprocessor
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "Backend",
    "ChatTemplate",
    "DecodedDelta",
    "Detokenizer",
    "Preprocessor",
    "StreamDecoder",
    "Tokenizer",
    "default_gguf_path",
    "load_model_card",
    "load_tokenizer",
]
