"""Clean cuts: places where a prompt's token ids split into ids of independent pieces.

A cut at position ``p`` of ``text`` is *clean* when ``encode(text) == encode(text[:p]) +
encode(text[p:])``. A prompt cut only at clean cuts can be encoded piece by piece, and a
piece seen before (the earlier turns of a conversation) need not be encoded again
(``llm.prompt_cache``). This module finds, once per tokenizer, a set of *boundary tokens*
after which every cut is clean, or says why it cannot.

Mental model (HF ``tokenizers``, ``encode(text, add_special_tokens=False)``)::

    text ──1──▶ split on added tokens (Aho-Corasick, leftmost-longest; lstrip/rstrip widen
     │          a match over neighbouring whitespace, single_word looks at neighbours)
     │    pieces ──2──▶ normalize each piece ──3──▶ pre-tokenize ──4──▶ model (BPE, ...)
     ▼
    ids = the added tokens' ids and each piece's ids, in order

Steps 2-4 see one piece at a time, so two texts with the same added-token split give the
same ids piece for piece. A cut right after an occurrence of a boundary token ``t`` is then
clean when the split of ``text`` is the split of ``text[:p]`` followed by that of
``text[p:]``, which holds when:

* every occurrence of ``t`` is an added-token match, and nothing crosses its end: no other
  added token contains ``t`` or starts before ``t`` and ends inside it (one that starts
  inside ``t`` is harmless: ``t`` starts first, and the match is the leftmost). ``t`` is
  matched before normalization (``normalized: false``) and does not swallow the whitespace
  after it (``rstrip: false``);
* nothing on one side looks across: ``t`` does not end in whitespace (which a token's
  ``lstrip`` on the right could otherwise extend over), and, when some added token is
  ``single_word``, ``t`` neither is one nor ends in a word character;
* the pipeline has no position-dependent step: no ``Metaspace`` pre-tokenizer that marks
  only the text's first piece (``prepend_scheme: first``: a piece at offset 0 alone is not
  at offset 0 in the whole), no BPE dropout (random), no truncation or padding, and special
  tokens are split out (``encode_special_tokens`` off). Pre-tokenizers are admitted by name
  (those known to work piece by piece); an unknown one refuses the tokenizer.

``find_boundaries`` checks all of that from the tokenizer's own configuration, then encodes
a probe text whole and in pieces and refuses the tokenizer if they differ (a guard against
a ``tokenizers`` release whose behaviour left this model).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

#: Pre-tokenizers that work on each piece alone, whatever its position.
_PIECEWISE_PRE_TOKENIZERS = frozenset(
    {
        "BertPreTokenizer",
        "ByteLevel",
        "CharDelimiterSplit",
        "Digits",
        "Metaspace",  # unless prepend_scheme is "first": see _pre_tokenizer_problem
        "Punctuation",
        "Sequence",
        "Split",
        "UnicodeScripts",
        "Whitespace",
        "WhitespaceSplit",
    }
)
#: Models whose ids for a word depend on that word alone (BPE: without dropout).
_DETERMINISTIC_MODELS = frozenset({"BPE", "Unigram", "WordLevel", "WordPiece"})
#: The most boundary tokens kept (cutting at fewer clean cuts is still exact): bounds the
#: analysis (quadratic in them) and the pattern that finds them in every prompt.
_MAX_CANDIDATES = 1024
_WORD_CHAR = re.compile(r"\w")


@dataclass(frozen=True, slots=True)
class TokenBoundaries:
    """A tokenizer's boundary tokens: every cut right after one of them is clean."""

    #: Matches any boundary token; its matches never overlap one another.
    pattern: re.Pattern[str]
    #: Each boundary token's id (its text as the key).
    ids: dict[str, int]

    def cuts(self, text: str) -> list[int]:
        """The clean cuts of ``text``, in order: the end of each boundary token in it."""
        return [m.end() for m in self.pattern.finditer(text)]


def find_boundaries(inner: HFTokenizer) -> TokenBoundaries | str:
    """The boundary tokens of ``inner``, or why it has none a cache could use."""
    problem = _pipeline_problem(inner)
    if problem is not None:
        return problem
    added = inner.get_added_tokens_decoder()
    candidates = _candidates(added)
    if not candidates:
        return "no added token makes a clean cut"
    boundaries = TokenBoundaries(
        pattern=re.compile("|".join(re.escape(c) for c in sorted(candidates, key=len)[::-1])),
        ids=candidates,
    )
    mismatch = _probe(inner, boundaries)
    if mismatch is not None:
        return mismatch
    return boundaries


def _pipeline_problem(inner: HFTokenizer) -> str | None:
    """Why some step of ``inner``'s pipeline depends on more than one piece, or None."""
    if inner.encode_special_tokens:
        return "the tokenizer encodes special tokens as text (encode_special_tokens)"
    if inner.truncation is not None or inner.padding is not None:
        return "the tokenizer truncates or pads"
    # The model's class, not its configuration: that would serialize the whole vocabulary.
    kind = type(inner.model).__name__
    if kind not in _DETERMINISTIC_MODELS:
        return f"tokenizer model {kind!r} is not known to encode word by word"
    if kind == "BPE" and inner.model.dropout:
        return "BPE dropout makes encoding random"
    pre = inner.pre_tokenizer
    return None if pre is None else _pre_tokenizer_problem(_state(pre))


def _state(component: Any) -> dict[str, Any]:
    """A ``tokenizers`` component's configuration, as its JSON (its part of ``tokenizer.json``)."""
    state = json.loads(component.__getstate__())
    return state if isinstance(state, dict) else {}


def _pre_tokenizer_problem(config: dict[str, Any]) -> str | None:
    kind = config.get("type")
    if kind not in _PIECEWISE_PRE_TOKENIZERS:
        return f"pre-tokenizer {kind!r} is not known to work piece by piece"
    if kind == "Metaspace" and config.get("prepend_scheme") == "first":
        return "the Metaspace pre-tokenizer marks only the text's first piece"
    for inner in config.get("pretokenizers") or ():
        problem = _pre_tokenizer_problem(inner)
        if problem is not None:
            return problem
    return None


def _candidates(added: dict[int, Any]) -> dict[str, int]:
    """Added tokens after which every cut is clean (module docstring), text -> id. At most
    ``_MAX_CANDIDATES``, special ones first: cutting at fewer clean cuts is still exact."""
    contents = [t.content for t in added.values() if t.content]
    any_single_word = any(t.single_word for t in added.values())
    copies: dict[str, int] = {}
    for c in contents:
        copies[c] = copies.get(c, 0) + 1
    eligible = [
        (not token.special, token_id, token.content)
        for token_id, token in added.items()
        if token.content
        and not (token.normalized or token.rstrip or token.single_word)
        and copies[token.content] == 1
        and not token.content[-1].isspace()
        and not (any_single_word and _WORD_CHAR.match(token.content[-1]))
    ]
    out = {c: token_id for _, token_id, c in sorted(eligible)[:_MAX_CANDIDATES]}
    if not out:
        return out
    # Another token containing c (c's own entry aside): all joined once, searched per c.
    joined = "\x00".join(contents)
    for c in [c for c in out if joined.count(c) > 1]:
        del out[c]
    # Another token s overlapping c's start (s = y + c[:k]): every proper prefix of a
    # candidate, indexed, against each token's proper suffixes. (A token that starts inside
    # c is harmless: c starts first, so the leftmost match is c.)
    by_prefix: dict[str, list[str]] = {}
    for c in out:
        for k in range(1, len(c)):
            by_prefix.setdefault(c[:k], []).append(c)
    for s in contents:
        for k in range(1, len(s)):
            for c in by_prefix.get(s[-k:], ()):
                out.pop(c, None)
    return out


def _probe(inner: HFTokenizer, boundaries: TokenBoundaries) -> str | None:
    """Encode a text holding each boundary token, with whitespace, digits and non-ASCII
    around it, whole and cut at its clean cuts: why the two differ, or None."""
    probed = sorted(boundaries.ids)
    text = "".join(f" x{c}  y\n{c}\n\n{c}é 12{c}{c}z\t" for c in probed) + " end"
    whole = inner.encode(text, add_special_tokens=False).ids
    pieces: list[int] = []
    start = 0
    for cut in [*boundaries.cuts(text), len(text)]:
        if cut > start:
            pieces += inner.encode(text[start:cut], add_special_tokens=False).ids
        start = cut
    if pieces != whole:
        return "a probe text encodes differently whole and in pieces"
    return None


__all__ = ["TokenBoundaries", "find_boundaries"]
