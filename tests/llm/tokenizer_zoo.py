"""Small tokenizers of every kind the prompt cache must get right, trained here (no download):
byte-level BPE with ChatML or Llama 3 special tokens, SentencePiece-style Metaspace (both
prepend schemes), BERT-style WordPiece with a lowercasing normalizer, and one with added
tokens that overlap, strip whitespace or match only single words."""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from turnout.llm.tokenizer import Tokenizer

CHATML_SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<stop>"]
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(8)),
]
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "abc abd abcd stop here STOP now   spaces\tand\ttabs\n\nnew lines",
    "numbers 123 456 and words words words, café naïve 漢字",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} system user assistant',
] * 20
#: Added tokens that interact with their neighbours (see ``hostile``).
HOSTILE_TOKENS = [
    AddedToken("<|a|>", special=True, normalized=False),
    AddedToken("<|b|>", special=True, normalized=False, rstrip=True),
    AddedToken("<|c|>", special=True, normalized=False, lstrip=True),
    AddedToken("<|d|>", special=True, normalized=False),
    AddedToken("x<|d|>", special=True, normalized=False),
    AddedToken("<|e|>", special=True, normalized=False),
    AddedToken("|>z", special=False, normalized=False),
    AddedToken("<|f|>", special=True, normalized=False),
    AddedToken("q<|f", special=False, normalized=False),
    AddedToken("<|g|> ", special=True, normalized=False),
    AddedToken("<end_h", special=True, normalized=False),
    AddedToken("word", special=False, normalized=False, single_word=True),
    AddedToken("<|n|>", special=True, normalized=True),
    AddedToken("<|i|>", special=True, normalized=False),
    AddedToken("|i|", special=False, normalized=False),
]


def _wrap(tok: HFTokenizer) -> Tokenizer:
    return Tokenizer.from_bytes(tok.to_str().encode())


def _byte_level_bpe(specials: list[str]) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def chatml() -> Tokenizer:
    return _wrap(_byte_level_bpe(CHATML_SPECIALS))


def llama3() -> Tokenizer:
    tok = _byte_level_bpe(LLAMA3_SPECIALS)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
                behavior="isolated",
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return _wrap(tok)


def _metaspace(prepend_scheme: str) -> Tokenizer:
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    tok.decoder = decoders.Metaspace(prepend_scheme=prepend_scheme)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", *CHATML_SPECIALS], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return _wrap(tok)


def metaspace_first() -> Tokenizer:
    """SentencePiece-style, ``▁`` before the text's first piece only: not piece by piece."""
    return _metaspace("first")


def metaspace_always() -> Tokenizer:
    return _metaspace("always")


def wordpiece() -> Tokenizer:
    tok = HFTokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=300,
        special_tokens=["[UNK]", "[CLS]", "[SEP]", "<|im_end|>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return _wrap(tok)


def hostile() -> Tokenizer:
    """Byte-level BPE plus ``HOSTILE_TOKENS``: of those only ``<|a|>``, ``<|c|>``, ``<|e|>``
    and ``<|i|>`` make clean cuts (``|>z`` and ``|i|`` start inside them: the leftmost match
    is theirs)."""
    tok = _byte_level_bpe(CHATML_SPECIALS)
    tok.add_tokens(HOSTILE_TOKENS)
    return _wrap(tok)


ZOO: dict[str, Callable[[], Tokenizer]] = {
    "chatml": chatml,
    "llama3": llama3,
    "metaspace_first": metaspace_first,
    "metaspace_always": metaspace_always,
    "wordpiece": wordpiece,
    "hostile": hostile,
}
