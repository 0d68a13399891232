"""The frontend's tokenizer: a thin, typed wrapper over Hugging Face ``tokenizers``.

A tokenizer is always built from the bytes of an HF ``tokenizer.json``: on the worker, read from
the model directory or built from a GGUF file's metadata (``gguf_tokenizer``); on the frontend,
fetched by content from a worker (``ArtifactRef``, see ``frontend.models.artifacts``). The frontend
never opens a path: :func:`load_tokenizer` takes the bytes and the reference they must match.
The result is a ``tokenizers.Tokenizer`` (Rust; encode/decode release the GIL for the heavy
work) plus the few ids the pipeline needs (bos, eos, the special ids).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from turnout.errors import ConfigError
from turnout.protocols.model import KIND_HF_TOKENIZER_JSON, ArtifactRef

from .gguf_tokenizer import gguf_tokenizer_json, read_gguf_metadata
from .token_boundaries import TokenBoundaries, find_boundaries

KIND_HF = KIND_HF_TOKENIZER_JSON


def token_content(value: Any) -> str | None:
    """A special token as written in HF configs: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, dict) else None
    return content if isinstance(content, str) else None


class Tokenizer:
    """Encode/decode with one model's vocabulary. Thread-safe; share it freely."""

    __slots__ = (
        "_boundaries",
        "_max_token_chars",
        "_special_ids",
        "_vocab_size",
        "bos_token_id",
        "eos_token_id",
        "inner",
        "kind",
        "sha256",
        "size",
    )

    def __init__(
        self,
        inner: HFTokenizer,
        *,
        sha256: str,
        size: int,
        kind: str = KIND_HF,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        #: The wrapped ``tokenizers.Tokenizer`` (what ``DecodeStream`` needs).
        self.inner = inner
        #: sha256 and length of the ``tokenizer.json`` bytes it was built from.
        self.sha256 = sha256
        self.size = size
        self.kind = kind
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self._vocab_size = inner.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(
            i for i, t in inner.get_added_tokens_decoder().items() if t.special
        )
        self._max_token_chars: int | None = None
        self._boundaries: TokenBoundaries | str | None = None

    # ------------------------------------------------------------ construction

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        origin: str = "tokenizer.json",
    ) -> Tokenizer:
        """Build from ``tokenizer.json`` bytes; ``bos_token``/``eos_token`` (as the model card
        names them) give the bos/eos ids. ``origin`` names the bytes in errors."""
        try:
            inner = HFTokenizer.from_buffer(data)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ConfigError(f"invalid tokenizer file {origin}: {e}") from e
        return cls(
            inner,
            sha256=hashlib.sha256(data).hexdigest(),
            size=len(data),
            bos_token_id=inner.token_to_id(bos_token) if bos_token else None,
            eos_token_id=inner.token_to_id(eos_token) if eos_token else None,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load an HF ``tokenizer.json`` from local disk (a worker's model directory, tests).
        bos/eos come from a ``tokenizer_config.json`` beside it, when there is one."""
        p = Path(path)
        try:
            data = p.read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read {p}: {e}") from e
        bos = eos = None
        cfg_path = p.with_name("tokenizer_config.json")
        if cfg_path.is_file():
            cfg = read_json(cfg_path)
            bos, eos = token_content(cfg.get("bos_token")), token_content(cfg.get("eos_token"))
        return cls.from_bytes(data, bos_token=bos, eos_token=eos, origin=str(p))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata, through the
        same ``tokenizer.json`` bytes a worker serves (only the header is read)."""
        data, info = gguf_tokenizer_json(read_gguf_metadata(path), path=path)
        tok = cls.from_bytes(data, origin=str(path))
        tok.bos_token_id = info.bos_token_id
        tok.eos_token_id = info.eos_token_id
        return tok

    def ref(self, name: str = "tokenizer.json") -> ArtifactRef:
        """The content reference of the bytes this tokenizer was built from."""
        return ArtifactRef(name=name, kind=self.kind, sha256=self.sha256, size=self.size)

    # ------------------------------------------------------------ use

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) map
        to their ids; ``add_special_tokens`` adds the model's BOS/EOS decoration, if any.

        Through ``encode_batch_fast``, which gives the same ids without tracking character
        offsets: a third less CPU on a 512-word prompt."""
        return self.inner.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.inner.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included: valid ids are ``range(vocab_size)``."""
        return self._vocab_size

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: no text of N characters encodes to
        fewer than N / max_token_chars tokens. The longer of each token's vocabulary entry
        (a byte-level or SentencePiece piece is at least as long as its text) and its text
        decoded alone, over the whole vocabulary, added tokens included. Computed on first
        use (~70 ms for 50k tokens: warm it off the event loop), then cached."""
        if self._max_token_chars is None:
            vocab = self.inner.get_vocab(with_added_tokens=True)
            pieces = max(map(len, vocab), default=1)
            decoded = self.inner.decode_batch(
                [[i] for i in range(self._vocab_size)], skip_special_tokens=False
            )
            self._max_token_chars = max(1, pieces, max(map(len, decoded), default=1))
        return self._max_token_chars

    @property
    def boundaries(self) -> TokenBoundaries | str:
        """The tokens after which a prompt may be cut and encoded piece by piece
        (``llm.token_boundaries``), or why there are none. Computed on first use (a few ms:
        warm it off the event loop), then cached."""
        if self._boundaries is None:
            self._boundaries = find_boundaries(self.inner)
        return self._boundaries

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind}, sha256={self.sha256[:12]}, vocab={self._vocab_size})"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file, or ``ConfigError`` naming the path."""
    try:
        with path.open("rb") as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    except ValueError as e:
        raise ConfigError(f"invalid JSON in {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_tokenizer(
    ref: ArtifactRef, data: bytes, *, bos_token: str | None = None, eos_token: str | None = None
) -> Tokenizer:
    """The tokenizer of artifact ``ref`` from its bytes ``data``, which must match it.

    Bytes that do not hash to ``ref.sha256`` (or are not ``ref.size`` long) are refused: a
    tokenizer other than the one the card names would encode prompts the worker misreads.
    Blocking (parsing a multi-MB JSON): call it off the event loop.
    """
    if ref.kind != KIND_HF:
        raise ConfigError(f"unknown tokenizer kind {ref.kind!r} (want {KIND_HF!r})")
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != ref.size or digest != ref.sha256:
        raise ConfigError(
            f"tokenizer {ref.name}: got {len(data)} bytes with sha256 {digest[:12]}..., but the "
            f"model card names {ref.size} bytes with sha256 {ref.sha256[:12]}..."
        )
    return Tokenizer.from_bytes(data, bos_token=bos_token, eos_token=eos_token, origin=ref.name)


__all__ = [
    "KIND_HF",
    "Tokenizer",
    "load_tokenizer",
    "read_json",
    "token_content",
]
