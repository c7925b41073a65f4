"""rotary_embedding (in place) against rotary_embedding_ref, and the reference against HF."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import device_for

from kvflow.kernels import build_cos_sin_cache, rotary_embedding, rotary_embedding_ref

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _run_case(device, dtype, tokens, q_heads, k_heads, head_dim, flat, pos_dtype):
    gen = torch.Generator().manual_seed(tokens * 7 + head_dim + q_heads)
    cache = build_cos_sin_cache(head_dim, 4096, 500000.0, LLAMA3_SCALING)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(pos_dtype)
    q = torch.randn(tokens, q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, k_heads, head_dim, generator=gen).to(dtype)
    if flat:
        q, k = q.flatten(1), k.flatten(1)
    expected_q, expected_k = rotary_embedding_ref(positions, q, k, cache, head_dim)
    q_dev, k_dev = q.to(device).clone(), k.to(device).clone()
    got_q, got_k = rotary_embedding(positions.to(device), q_dev, k_dev, cache.to(device), head_dim)
    assert got_q is q_dev and got_k is k_dev  # in place
    torch.testing.assert_close(q_dev.cpu(), expected_q)
    torch.testing.assert_close(k_dev.cpu(), expected_k)
    assert not torch.equal(q_dev.cpu(), q)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("tokens", "q_heads", "k_heads", "head_dim", "flat", "pos_dtype"),
    [
        (3, 4, 2, 64, True, torch.int64),
        (5, 9, 3, 64, False, torch.int32),
        (2, 2, 1, 32, False, torch.int64),
    ],
)
def test_rotary_embedding_interpret(dtype, tokens, q_heads, k_heads, head_dim, flat, pos_dtype):
    _run_case(device_for("interpret"), dtype, tokens, q_heads, k_heads, head_dim, flat, pos_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("tokens", "q_heads", "k_heads", "head_dim", "flat", "pos_dtype"),
    [
        (1, 32, 8, 128, True, torch.int64),
        (1000, 32, 8, 128, False, torch.int64),
        (77, 9, 3, 64, True, torch.int32),
        (5, 12, 12, 80, False, torch.int64),
    ],
)
def test_rotary_embedding_gpu(dtype, tokens, q_heads, k_heads, head_dim, flat, pos_dtype):
    _run_case(device_for("gpu"), dtype, tokens, q_heads, k_heads, head_dim, flat, pos_dtype)


def test_rotary_embedding_ref_matches_hf_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(4)
    head_dim, tokens = 64, 6
    cache = build_cos_sin_cache(head_dim, 128, 10000.0)
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    q = torch.randn(tokens, 4, head_dim, generator=gen)
    k = torch.randn(tokens, 2, head_dim, generator=gen)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # [1, t, d]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, cache, head_dim)
    torch.testing.assert_close(ref_q, hf_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ref_k, hf_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
