"""Mixture-of-experts families on a GPU: the fused MoE kernel inside the engine (CUDA graphs
on, float32) gives transformers' greedy tokens on the same random weights, for Qwen3-MoE
(16 experts, top 4, a dense layer) and Mixtral.

Skipped without CUDA; run on the accelerator machine with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from family_parity import build_hf, engine_greedy, hf_greedy, prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MOE = {"num_experts_per_tok": 4, "num_key_value_heads": 2, "eos_token_id": 2}
FAMILIES = {
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {**MOE, "num_experts": 16, "moe_intermediate_size": 48, "head_dim": 32}
        | {"norm_topk_prob": True, "mlp_only_layers": [1]},
    ),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {**MOE, "num_local_experts": 8}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_family_on_cuda_equals_transformers(tmp_path, family):
    model_cls, config_cls, config = FAMILIES[family]
    hf = build_hf(tmp_path, model_cls, config_cls, **config)
    batch = prompts()
    expected = hf_greedy(hf, batch)
    got = engine_greedy(tmp_path, batch, device="cuda", max_running_requests=8, cuda_graph_max_bs=8)
    assert got == expected
