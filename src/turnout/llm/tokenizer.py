"""The frontend's tokenizer: a thin, typed wrapper over Hugging Face ``tokenizers``.

Two sources (``TokenizerSource.kind``): an HF ``tokenizer.json`` (``"hf_tokenizer_json"``) or a
GGUF file whose metadata holds the vocabulary (``"gguf"``). Either way the result is a
``tokenizers.Tokenizer`` (Rust; encode/decode release the GIL for the heavy work) plus the few
ids the pipeline needs (bos, eos, the special ids).

:func:`load_tokenizer` keeps one instance per distinct file content (keyed by sha256) for the
life of the process: every instance of a model, and every LoRA of it, shares one tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from turnout.errors import ConfigError
from turnout.protocols.model import TokenizerSource

from .gguf_tokenizer import build_gguf_tokenizer, read_gguf_metadata

KIND_HF = "hf_tokenizer_json"
KIND_GGUF = "gguf"

_sha_lock = threading.Lock()
#: (path, size, mtime_ns) -> sha256, so a 100 MB GGUF is hashed once per process.
_sha_cache: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (memoized on path, size and mtime)."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as e:
        raise ConfigError(f"cannot read {p}: {e}") from e
    key = (str(p), st.st_size, st.st_mtime_ns)
    with _sha_lock:
        cached = _sha_cache.get(key)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    try:
        with p.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as e:
        raise ConfigError(f"cannot read {p}: {e}") from e
    digest = h.hexdigest()
    with _sha_lock:
        _sha_cache[key] = digest
    return digest


def token_content(value: Any) -> str | None:
    """A special token as written in HF configs: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, dict) else None
    return content if isinstance(content, str) else None


class Tokenizer:
    """Encode/decode with one model's vocabulary. Thread-safe; share it freely."""

    __slots__ = (
        "_special_ids",
        "_vocab_size",
        "bos_token_id",
        "eos_token_id",
        "inner",
        "kind",
        "path",
        "sha256",
    )

    def __init__(
        self,
        inner: HFTokenizer,
        *,
        sha256: str,
        kind: str,
        path: str,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        #: The wrapped ``tokenizers.Tokenizer`` (what ``DecodeStream`` needs).
        self.inner = inner
        self.sha256 = sha256
        self.kind = kind
        self.path = path
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self._vocab_size = inner.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(
            i for i, t in inner.get_added_tokens_decoder().items() if t.special
        )

    # ------------------------------------------------------------ construction

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load an HF ``tokenizer.json``. bos/eos come from a ``tokenizer_config.json`` beside
        it, when there is one."""
        p = Path(path)
        sha = file_sha256(p)
        try:
            inner = HFTokenizer.from_file(str(p))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ConfigError(f"invalid tokenizer file {p}: {e}") from e
        bos_id = eos_id = None
        cfg_path = p.with_name("tokenizer_config.json")
        if cfg_path.is_file():
            cfg = read_json(cfg_path)
            bos, eos = token_content(cfg.get("bos_token")), token_content(cfg.get("eos_token"))
            bos_id = inner.token_to_id(bos) if bos else None
            eos_id = inner.token_to_id(eos) if eos else None
        return cls(
            inner, sha256=sha, kind=KIND_HF, path=str(p), bos_token_id=bos_id, eos_token_id=eos_id
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata."""
        p = Path(path)
        sha = file_sha256(p)
        inner, info = build_gguf_tokenizer(read_gguf_metadata(p), path=p)
        return cls(
            inner,
            sha256=sha,
            kind=KIND_GGUF,
            path=str(p),
            bos_token_id=info.bos_token_id,
            eos_token_id=info.eos_token_id,
        )

    # ------------------------------------------------------------ use

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) map
        to their ids; ``add_special_tokens`` adds the model's BOS/EOS decoration, if any."""
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids

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

    def source(self) -> TokenizerSource:
        return TokenizerSource(kind=self.kind, path=self.path, sha256=self.sha256)

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind}, {self.path!r}, vocab={self._vocab_size})"


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


_cache_lock = threading.Lock()
_cache: dict[str, Tokenizer] = {}


def load_tokenizer(source: TokenizerSource) -> Tokenizer:
    """The process-wide tokenizer for ``source`` (one per sha256).

    The file at ``source.path`` must still hash to ``source.sha256``: a card written against
    another version of the file is a configuration error, not something to paper over.
    Blocking (file I/O, hashing): call it off the event loop.
    """
    with _cache_lock:
        tok = _cache.get(source.sha256)
    if tok is not None:
        return tok
    if source.kind == KIND_GGUF:
        tok = Tokenizer.from_gguf(source.path)
    elif source.kind == KIND_HF:
        tok = Tokenizer.from_file(source.path)
    else:
        raise ConfigError(
            f"unknown tokenizer kind {source.kind!r} (want {KIND_HF!r} or {KIND_GGUF!r})"
        )
    if tok.sha256 != source.sha256:
        raise ConfigError(
            f"tokenizer file {source.path} has sha256 {tok.sha256[:12]}..., but the model card "
            f"expects {source.sha256[:12]}...: the file changed or the card is from another host"
        )
    with _cache_lock:
        return _cache.setdefault(source.sha256, tok)


def clear_tokenizer_cache() -> None:
    """Forget loaded tokenizers and memoized file digests (tests, benchmarks)."""
    with _cache_lock:
        _cache.clear()
    with _sha_lock:
        _sha_cache.clear()


__all__ = [
    "KIND_GGUF",
    "KIND_HF",
    "Tokenizer",
    "clear_tokenizer_cache",
    "file_sha256",
    "load_tokenizer",
    "read_json",
    "token_content",
]
