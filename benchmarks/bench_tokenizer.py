"""A benchmark tokenizer with exactly a model's vocabulary size (GPU runs on dummy weights).

The GPU machine has no model hub, so bench_serving and ``kvflow serve`` use the embedded
model's (SmolLM2) byte-level BPE tokenizer, 49,152 ids, resized to the shape's
``vocab_size``:

- larger vocabularies (Llama 128,256, Qwen 151,936, Gemma 256,000) are padded with added
  tokens ``<|padN|>``, so every id the random-weight model samples decodes to text (else
  bench_serving drops those chunks and TTFT/ITL come out wrong);
- smaller ones (Mistral v0.3, 32,768) keep the ids below the size and the merges that make
  only kept tokens, so every prompt encodes to ids the model has (BPE falls back to the
  shorter pieces; the byte alphabet has the lowest ids).

Usage: ``python bench_tokenizer.py SRC_DIR DST_DIR VOCAB_SIZE`` (SRC_DIR holds
``tokenizer.json`` and ``tokenizer_config.json``; pads of an earlier resize are dropped).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

PAD = "<|pad{}|>"


def _merge_parts(merge: str | list[str]) -> tuple[str, str]:
    left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
    return left, right


def resize(tokenizer: dict[str, Any], size: int) -> dict[str, Any]:
    """``tokenizer`` (a tokenizer.json body) with ids ``0 .. size-1``, each decoding to text."""
    model = tokenizer["model"]
    vocab = {t: i for t, i in model["vocab"].items() if i < size}
    merges = []
    for merge in model.get("merges", []):
        left, right = _merge_parts(merge)
        if left in vocab and right in vocab and left + right in vocab:
            merges.append(merge)
    added = [
        a
        for a in tokenizer.get("added_tokens", [])
        if a["id"] < size and a["content"] != PAD.format(a["id"])
    ]
    used = {a["id"] for a in added} | set(vocab.values())
    for i in range(max(used) + 1, size):
        added.append(
            {"id": i, "content": PAD.format(i), "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": False}
        )  # fmt: skip
    missing = sorted(set(range(size)) - used - {a["id"] for a in added})
    if missing:
        raise ValueError(f"ids {missing[:5]}... have no token after resizing to {size}")
    return {
        **tokenizer,
        "model": {**model, "vocab": vocab, "merges": merges},
        "added_tokens": added,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    src, dst, size = Path(argv[0]), Path(argv[1]), int(argv[2])
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer_config.json", dst / "tokenizer_config.json")
    body = resize(json.loads((src / "tokenizer.json").read_text()), size)
    (dst / "tokenizer.json").write_text(json.dumps(body))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
