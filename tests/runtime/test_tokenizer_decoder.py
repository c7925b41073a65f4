"""The detokenizer's decoder (``tokenizers`` straight from tokenizer.json) decodes as
transformers' tokenizer does, and the detokenizer process starts without torch."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from kvflow.runtime.tokenizer import load_decoder


def test_decoder_equals_transformers_decode(model_path, tokenizer):
    decoder = load_decoder(model_path)
    assert type(decoder).__module__.startswith("tokenizers")  # the fast path is taken here
    rng = random.Random(0)
    texts = ["Hello, world!", "caf\u00e9 \u2014 \u65e5\u672c\u8a9e \U0001f600", "  two  spaces\n"]
    samples = [tokenizer.encode(t) for t in texts]
    samples += [[rng.randrange(tokenizer.vocab_size) for _ in range(40)] for _ in range(50)]
    samples.append([1, *tokenizer.encode("<|im_start|>user\nHi<|im_end|>"), 2])
    for ids in samples:
        for skip in (True, False):
            assert decoder.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            )


@pytest.mark.parametrize("config", ['{"tokenizer_class": "LlamaTokenizer"}', "{}"])
def test_other_tokenizer_classes_keep_transformers(model_path, tmp_path, config):
    for name in ("tokenizer.json", "special_tokens_map.json"):
        if (model_path / name).is_file():
            (tmp_path / name).write_bytes((model_path / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(config)
    assert not type(load_decoder(tmp_path)).__module__.startswith("tokenizers")


def test_detokenizer_process_imports_no_torch(model_path):
    code = (
        "import sys; from pathlib import Path\n"
        "from kvflow.runtime.server.lifeline import run_tied_to_parent\n"
        "from kvflow.runtime.server.detokenizer_process import run_detokenizer_process\n"
        "from kvflow.runtime.tokenizer import load_decoder\n"
        f"load_decoder(Path({str(model_path)!r}))\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]
