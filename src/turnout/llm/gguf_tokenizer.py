"""Build a Hugging Face ``tokenizers`` tokenizer from a GGUF file's own metadata.

A GGUF file carries its vocabulary under ``tokenizer.ggml.*``. For ``tokenizer.ggml.model ==
"gpt2"`` (byte-level BPE: GPT-2, Llama 3, Qwen 2, SmolLM, StarCoder, ...) the tokens and merges
are exactly a ``tokenizers`` BPE model; what the file does not store is the pre-tokenizer, only
its name (``tokenizer.ggml.pre``), which llama.cpp maps to a split regex in ``llama-vocab.cpp``.
We do the same mapping for the names we know and fall back to the GPT-2 byte-level split.

Other tokenizer models (``llama`` = SentencePiece, ``bert``, ``t5``, ``rwkv``) are rejected with
a clear error instead of guessed at — unless the file embeds the original
``tokenizer.huggingface.json``, which is then used as is.

Why a hand-rolled metadata reader: ``gguf.GGUFReader`` builds a numpy view for every array
element of every field and indexes all tensors; on SmolLM2 (49k tokens, 49k merges) that is
~4 s. Reading only the key/value header with ``struct`` takes well under a second, which keeps
the frontend's model start-up fast. The value-type codes come from the ``gguf`` package.
"""

from __future__ import annotations

import logging
import mmap
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from turnout.errors import ConfigError

log = logging.getLogger(__name__)

_VT = gguf.GGUFValueType

#: Scalar value types: struct format (little-endian) of one value.
_SCALAR_FORMATS: dict[int, str] = {
    _VT.UINT8: "<B",
    _VT.INT8: "<b",
    _VT.UINT16: "<H",
    _VT.INT16: "<h",
    _VT.UINT32: "<I",
    _VT.INT32: "<i",
    _VT.FLOAT32: "<f",
    _VT.BOOL: "<?",
    _VT.UINT64: "<Q",
    _VT.INT64: "<q",
    _VT.FLOAT64: "<d",
}
#: The same types as numpy dtypes, for reading numeric arrays in one go.
_NUMPY_DTYPES: dict[int, str] = {
    _VT.UINT8: "<u1",
    _VT.INT8: "<i1",
    _VT.UINT16: "<u2",
    _VT.INT16: "<i2",
    _VT.UINT32: "<u4",
    _VT.INT32: "<i4",
    _VT.FLOAT32: "<f4",
    _VT.BOOL: "?",
    _VT.UINT64: "<u8",
    _VT.INT64: "<i8",
    _VT.FLOAT64: "<f8",
}


class _HeaderReader:
    """A cursor over the GGUF key/value header (little-endian GGUF v2/v3)."""

    __slots__ = ("buf", "path", "pos")

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf = buf
        self.path = path
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ConfigError(f"{self.path}: truncated GGUF header (string past end of file)")
        raw = self.buf[self.pos : end]
        self.pos = end
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{self.path}: GGUF string is not valid UTF-8: {e}") from e

    def value(self, vtype: int) -> Any:
        if vtype == _VT.STRING:
            return self.string()
        if vtype == _VT.ARRAY:
            etype = self.unpack("<I")
            count = self.unpack("<Q")
            if etype == _VT.STRING:
                return [self.string() for _ in range(count)]
            if etype == _VT.ARRAY:
                return [self.value(_VT.ARRAY) for _ in range(count)]
            dtype = _NUMPY_DTYPES.get(etype)
            if dtype is None:
                raise ConfigError(f"{self.path}: unknown GGUF array element type {etype}")
            if self.pos + count * np.dtype(dtype).itemsize > len(self.buf):
                raise ConfigError(f"{self.path}: truncated GGUF header (array past end of file)")
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise ConfigError(f"{self.path}: unknown GGUF value type {vtype}")
        return self.unpack(fmt)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Read every key/value pair of a GGUF file's header (tensors are not touched).

    Raises ``ConfigError`` naming the path when the file is missing or is not a GGUF file.
    """
    path = Path(path)
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = memoryview(mm)
            try:
                return _read_header(_HeaderReader(buf, path))
            except struct.error as e:
                raise ConfigError(f"{path}: truncated or corrupt GGUF header ({e})") from e
            finally:
                buf.release()
    except OSError as e:
        raise ConfigError(f"cannot read GGUF file {path}: {e}") from e
    except ValueError as e:  # mmap of an empty file
        raise ConfigError(f"{path}: not a GGUF file ({e})") from e


def _read_header(r: _HeaderReader) -> dict[str, Any]:
    magic = r.unpack("<I")
    if magic != gguf.GGUF_MAGIC:
        raise ConfigError(f"{r.path}: not a GGUF file (bad magic {magic:#x})")
    version = r.unpack("<I")
    if version not in (2, 3):
        # A big-endian file reads as a huge version number; v1 used 32-bit lengths.
        raise ConfigError(f"{r.path}: unsupported GGUF version {version} (want 2 or 3, LE)")
    r.unpack("<Q")  # tensor count
    kv_count = r.unpack("<Q")
    meta: dict[str, Any] = {}
    for _ in range(kv_count):
        key = r.string()
        meta[key] = r.value(r.unpack("<I"))
    return meta


# ----------------------------------------------------------------- pre-tokenizers

#: GPT-2's split (what ``ByteLevel(use_regex=True)`` applies).
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` names whose llama.cpp regexes are "each digit alone, then GPT-2".
_DIGITS_THEN_GPT2 = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_LLAMA3_LIKE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"})
_QWEN2_LIKE = frozenset({"qwen2", "deepseek-r1-qwen"})
_GPT2_LIKE = frozenset({"default", "gpt2", "gpt-2"})


def make_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre == pre``.

    Unknown names fall back to GPT-2's byte-level split, with a warning: encoding may then
    differ from llama.cpp's at some word boundaries, but decoding is always exact.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _LLAMA3_LIKE:
        pattern = _LLAMA3_PATTERN
    elif pre in _QWEN2_LIKE:
        pattern = _QWEN2_PATTERN
    else:
        if pre is not None and pre not in _GPT2_LIKE:
            log.warning("unknown tokenizer.ggml.pre %r: using the GPT-2 byte-level split", pre)
        pattern = _GPT2_PATTERN
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False), byte_level]
    )


# ----------------------------------------------------------------- the tokenizer


class GGUFTokenizerInfo:
    """What :func:`build_gguf_tokenizer` returns beside the tokenizer: the ids llama.cpp uses."""

    __slots__ = ("add_bos", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")

    def __init__(
        self,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        unk_token_id: int | None,
        pad_token_id: int | None,
        add_bos: bool,
    ) -> None:
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos


def _opt_id(meta: dict[str, Any], key: str, n_vocab: int) -> int | None:
    value = meta.get(key)
    if isinstance(value, int) and 0 <= value < n_vocab:
        return value
    return None


def build_gguf_tokenizer(
    meta: dict[str, Any], *, path: str | Path = "<gguf>"
) -> tuple[HFTokenizer, GGUFTokenizerInfo]:
    """A ``tokenizers.Tokenizer`` equivalent to llama.cpp's for this GGUF metadata.

    Control tokens (token type 3) become special added tokens (matched verbatim in text,
    dropped by ``skip_special_tokens``); user-defined tokens (type 4) become normal added
    tokens. Raises ``ConfigError`` for tokenizer models other than ``gpt2``.
    """
    model = meta.get(gguf.Keys.Tokenizer.MODEL)
    tokens = meta.get(gguf.Keys.Tokenizer.LIST)
    if model != "gpt2":
        embedded = meta.get(gguf.Keys.Tokenizer.HF_JSON)
        if isinstance(embedded, str) and embedded:
            tok = HFTokenizer.from_str(embedded)
            n = tok.get_vocab_size(with_added_tokens=True)
            return tok, _info(meta, n)
        raise ConfigError(
            f"{path}: GGUF tokenizer model {model!r} is not supported; only 'gpt2' "
            "(byte-level BPE) is. Serve this model with a Hugging Face tokenizer.json instead."
        )
    if not isinstance(tokens, list) or not tokens:
        raise ConfigError(f"{path}: GGUF file has no {gguf.Keys.Tokenizer.LIST}")
    merges_raw = meta.get(gguf.Keys.Tokenizer.MERGES) or []
    token_types = meta.get(gguf.Keys.Tokenizer.TOKEN_TYPE) or [gguf.TokenType.NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise ConfigError(f"{path}: {len(tokens)} tokens but {len(token_types)} token types")

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicate string keeps its first id, as llama.cpp does
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ConfigError(f"{path}: malformed BPE merge {m!r}")
        merges.append((left, right))

    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = make_pre_tokenizer(meta.get(gguf.Keys.Tokenizer.PRE))
    tok.decoder = decoders.ByteLevel()

    special: list[AddedToken] = []
    user: list[AddedToken] = []
    for i, (t, ttype) in enumerate(zip(tokens, token_types, strict=True)):
        if vocab[t] != i:
            continue
        if ttype in (gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN):
            special.append(AddedToken(t, special=True, normalized=False))
        elif ttype == gguf.TokenType.USER_DEFINED:
            user.append(AddedToken(t, special=False, normalized=False))
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    info = _info(meta, len(tokens))
    if info.add_bos and info.bos_token_id is not None:
        bos = tokens[info.bos_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, info.bos_token_id)]
        )
    return tok, info


def gguf_tokenizer_json(
    meta: dict[str, Any], *, path: str | Path = "<gguf>"
) -> tuple[bytes, GGUFTokenizerInfo]:
    """The ``tokenizer.json`` bytes of the tokenizer :func:`build_gguf_tokenizer` makes from
    this metadata: what a worker serving a GGUF model publishes as its tokenizer artifact, so
    the frontend never needs the GGUF file (nor, of course, its weights)."""
    tok, info = build_gguf_tokenizer(meta, path=path)
    return tok.to_str().encode("utf-8"), info


def _info(meta: dict[str, Any], n_vocab: int) -> GGUFTokenizerInfo:
    return GGUFTokenizerInfo(
        bos_token_id=_opt_id(meta, gguf.Keys.Tokenizer.BOS_ID, n_vocab),
        eos_token_id=_opt_id(meta, gguf.Keys.Tokenizer.EOS_ID, n_vocab),
        unk_token_id=_opt_id(meta, gguf.Keys.Tokenizer.UNK_ID, n_vocab),
        pad_token_id=_opt_id(meta, gguf.Keys.Tokenizer.PAD_ID, n_vocab),
        add_bos=bool(meta.get(gguf.Keys.Tokenizer.ADD_BOS, False)),
    )
