"""The detokenizer's decoder (``tokenizers`` straight from tokenizer.json) decodes as
transformers' tokenizer does, and the detokenizer process starts without torch; the
tokenizer loaded without AutoTokenizer is AutoTokenizer's."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from kvflow.runtime.tokenizer import _plain_fast, apply_chat_template, load_decoder, load_tokenizer


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


@pytest.mark.parametrize("tokenizer_class", ["TokenizersBackend", "PreTrainedTokenizerFast"])
def test_direct_load_equals_auto_tokenizer(model_path, tmp_path, tokenizer_class):
    """load_tokenizer skips AutoTokenizer (and its torch import) for a plain fast tokenizer
    of a Llama; what it loads must be what AutoTokenizer loads."""
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "chat_template.jinja", "config.json"):
        if (model_path / name).is_file():
            (tmp_path / name).write_bytes((model_path / name).read_bytes())
    config = json.loads((model_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": tokenizer_class})
    )
    direct, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(direct) is type(auto)
    assert direct.get_vocab() == auto.get_vocab()
    assert direct.all_special_ids == auto.all_special_ids
    assert direct.chat_template == auto.chat_template and direct.chat_template
    texts = ["Hello, world!", "caf\u00e9 \u2014 \u65e5\u672c\u8a9e", "<|im_start|>user\nHi"]
    for text in texts:
        assert direct.encode(text) == auto.encode(text)
        chat = [{"role": "user", "content": text}]
        assert apply_chat_template(direct, chat) == apply_chat_template(auto, chat)
    ids = direct.encode(texts[1])
    assert direct.decode(ids) == auto.decode(ids)
    assert direct.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)


def test_other_model_types_keep_auto_tokenizer(model_path, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_path / name).read_bytes())
    config = json.loads((model_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    assert not _plain_fast(tmp_path)
    assert _plain_fast(model_path)  # the embedded model takes the direct load
