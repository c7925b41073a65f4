"""Qwen3 dense against transformers: per-head q/k RMSNorm before RoPE, no QKV bias,
head_dim from the config (32 here, not hidden / heads = 16), at tp 1 and tp 2."""

from __future__ import annotations

import pytest
from family_parity import GREEDY, build_hf, engine_greedy, hf_greedy, prompts
from tp_ranks import run_ranks

from kvflow.runtime.config import ModelConfig

QWEN3 = {"num_key_value_heads": 2, "head_dim": 32}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen3_equals_transformers(tmp_path, tied):
    hf = build_hf(tmp_path, "Qwen3ForCausalLM", "Qwen3Config", **QWEN3, tie_word_embeddings=tied)
    config = ModelConfig.from_path(tmp_path)
    assert (config.head_dim, config.attention_bias) == (32, False)
    batch = prompts()
    assert engine_greedy(tmp_path, batch) == hf_greedy(hf, batch)


def test_qwen3_tp2_equals_transformers(tmp_path):
    """One KV head per rank; the q/k norm weights whole on both."""
    hf = build_hf(tmp_path, "Qwen3ForCausalLM", "Qwen3Config", **QWEN3)
    batch = prompts()
    expected = hf_greedy(hf, batch)
    calls = [{"input_ids": batch, "sampling_params": GREEDY}]
    reports = run_ranks(2, str(tmp_path), calls, dtype="float32", skip_tokenizer_init=True)
    assert [r["outputs"] for r in reports] == [[expected]] * 2
    assert [r["kv_heads"] for r in reports] == [1, 1]
