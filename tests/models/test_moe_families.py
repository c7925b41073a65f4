"""Mixtral and Qwen3-MoE against transformers, greedy token for token: 4 experts, top 2,
2 layers, hidden 64. Qwen3-MoE with a dense layer (``mlp_only_layers``), with and
without ``norm_topk_prob``, and at tp 2 (each rank half of every expert's width)."""

from __future__ import annotations

import pytest
from family_parity import GREEDY, build_hf, engine_greedy, hf_greedy, prompts
from tp_ranks import run_ranks

from kvflow.runtime.config import ModelConfig

# eos 2 as hf_greedy stops at it (Qwen3MoeConfig has none by default)
MOE = {"num_experts_per_tok": 2, "num_key_value_heads": 2, "eos_token_id": 2}
MIXTRAL = {**MOE, "num_local_experts": 4}
QWEN3_MOE = {**MOE, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 32}


def test_mixtral_equals_transformers(tmp_path):
    hf = build_hf(tmp_path, "MixtralForCausalLM", "MixtralConfig", **MIXTRAL)
    config = ModelConfig.from_path(tmp_path)
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert (config.moe_intermediate_size, config.norm_topk_prob) == (128, True)
    batch = prompts()
    assert engine_greedy(tmp_path, batch) == hf_greedy(hf, batch)


@pytest.mark.parametrize(
    "extra",
    [{"norm_topk_prob": True, "mlp_only_layers": [1]}, {"norm_topk_prob": False}],
    ids=["renormalised-dense-layer-1", "not-renormalised"],
)
def test_qwen3_moe_equals_transformers(tmp_path, extra):
    hf = build_hf(tmp_path, "Qwen3MoeForCausalLM", "Qwen3MoeConfig", **QWEN3_MOE, **extra)
    config = ModelConfig.from_path(tmp_path)
    assert config.norm_topk_prob == extra["norm_topk_prob"]
    sparse = [config.is_sparse_layer(i) for i in range(2)]
    assert sparse == [True, not extra.get("mlp_only_layers")]
    batch = prompts()
    assert engine_greedy(tmp_path, batch) == hf_greedy(hf, batch)


def test_qwen3_moe_tp2_equals_transformers(tmp_path):
    """Each rank holds 16 of every expert's 32 intermediate rows; the router is whole."""
    hf = build_hf(
        tmp_path, "Qwen3MoeForCausalLM", "Qwen3MoeConfig", **QWEN3_MOE, norm_topk_prob=True
    )
    batch = prompts()
    expected = hf_greedy(hf, batch)
    calls = [{"input_ids": batch, "sampling_params": GREEDY}]
    reports = run_ranks(2, str(tmp_path), calls, dtype="float32", skip_tokenizer_init=True)
    assert [r["outputs"] for r in reports] == [[expected]] * 2
