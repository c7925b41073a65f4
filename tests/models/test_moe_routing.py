"""The mixture-of-experts layer against transformers' routers and expert blocks on random
hidden states: the same experts chosen, the same weights, the same block output; and the
CUDA-graph (dense) path equals the grouped one."""

from __future__ import annotations

import pytest
import torch

from kvflow.runtime.layers import (
    SparseMoE,
    TopK,
    fused_experts_ref,
    select_experts,
)

TINY_MOE = {"hidden_size": 64, "num_experts_per_tok": 2, "num_hidden_layers": 1}


def _hf_block(family: str, **config: object) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = transformers.MixtralConfig(**TINY_MOE, intermediate_size=96, num_local_experts=4)
        block = MixtralSparseMoeBlock(cfg)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = transformers.Qwen3MoeConfig(
            **TINY_MOE, moe_intermediate_size=48, num_experts=6, **config
        )
        block = Qwen3MoeSparseMoeBlock(cfg)
    for param in block.parameters():
        param.data.normal_(0, 0.3)
    return block.eval()


def _ours(hf: torch.nn.Module, renormalize: bool) -> SparseMoE:
    experts, top_k = hf.experts.gate_up_proj.shape[0], hf.gate.top_k
    inter = hf.experts.down_proj.shape[-1]
    moe = SparseMoE(experts, top_k, 64, inter, renormalize)
    moe.gate.weight.data.copy_(hf.gate.weight)
    moe.experts.w13.weight.data.copy_(hf.experts.gate_up_proj)  # [gate; up] as ours
    moe.experts.w2.weight.data.copy_(hf.experts.down_proj)
    moe.gate.process_weights_after_loading()
    return moe


CASES = [("mixtral", {}, True), ("qwen3", {"norm_topk_prob": True}, True)]
CASES += [("qwen3", {"norm_topk_prob": False}, False)]


@pytest.mark.parametrize(("family", "config", "renormalize"), CASES)
def test_routing_and_block_equal_transformers(family, config, renormalize):
    hf = _hf_block(family, **config)
    hidden = torch.randn(37, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, hf_weights, hf_ids = hf.gate(hidden)
        topk = select_experts(logits, hf.gate.top_k, renormalize)
        assert torch.equal(topk.ids, hf_ids)
        torch.testing.assert_close(topk.weights, hf_weights.float(), rtol=0, atol=1e-6)
        if renormalize:
            torch.testing.assert_close(topk.weights.sum(-1), torch.ones(37))
        expected = hf(hidden[None])[0]
        got = _ours(hf, renormalize)(hidden)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_unused_experts_and_single_token():
    """Experts no token picked are skipped; one token works."""
    w13 = torch.randn(5, 32, 8)
    w2 = torch.randn(5, 8, 16)
    hidden = torch.randn(1, 8)
    topk = TopK(torch.tensor([[0.7, 0.3]]), torch.tensor([[4, 1]]))
    out = fused_experts_ref(hidden, w13, w2, topk)

    def expert(e: int) -> torch.Tensor:
        gate, up = (hidden @ w13[e].T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ w2[e].T

    torch.testing.assert_close(out, 0.7 * expert(4) + 0.3 * expert(1))


def test_grouped_path_equals_the_fused_kernels_contract():
    """The CPU path (grouped per expert) gives what the CUDA kernel is tested against."""
    from kvflow.kernels import fused_moe_ref

    g = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(6, 32, 8, generator=g), torch.randn(6, 8, 16, generator=g)
    hidden = torch.randn(19, 8, generator=g)
    topk = select_experts(torch.randn(19, 6, generator=g), 2, True)
    grouped = fused_experts_ref(hidden, w13, w2, topk)
    expected = fused_moe_ref(hidden, w13, w2, topk.weights, topk.ids)
    torch.testing.assert_close(grouped, expected, atol=1e-4, rtol=1e-4)
