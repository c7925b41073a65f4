"""silu_and_mul, gelu_tanh_and_mul and store_kv_cache against their torch references."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import device_for

from kvflow.kernels import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_ref,
    silu_and_mul,
    silu_and_mul_ref,
    store_kv_cache,
    store_kv_cache_ref,
)

GATED = {
    "silu": (silu_and_mul, silu_and_mul_ref),
    "gelu_tanh": (gelu_tanh_and_mul, gelu_tanh_and_mul_ref),
}


def _check_silu_and_mul(device, dtype, tokens, intermediate, act="silu"):
    kernel, reference = GATED[act]
    gen = torch.Generator().manual_seed(tokens + intermediate)
    x = (torch.randn(tokens, 2 * intermediate, generator=gen) * 4).to(dtype)
    got = kernel(x.to(device))
    assert got.shape == (tokens, intermediate) and got.dtype == dtype
    # fp16: Triton's sigmoid and torch's silu (tanh) may round the activation one ulp
    # apart, and the product with `up` carries that (seen on H100: 5 of 153600 elements,
    # 1.5e-3 rel).
    close = {"atol": 1e-4, "rtol": 3e-3} if dtype == torch.float16 else {}
    torch.testing.assert_close(got.cpu(), reference(x), **close)


def _check_store_kv(device, dtype, loc_dtype, tokens, num_heads, head_dim):
    gen = torch.Generator().manual_seed(tokens * num_heads + head_dim)
    num_slots = 4 * tokens + 3
    k_buffer = torch.randn(num_slots, num_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(num_slots, num_heads, head_dim, generator=gen).to(dtype)
    loc = torch.randperm(num_slots, generator=gen)[:tokens].to(loc_dtype)
    k = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    original_k = k_buffer.clone()
    expected_k, expected_v = k_buffer.clone(), v_buffer.clone()
    store_kv_cache_ref(expected_k, expected_v, loc, k, v)
    got_k, got_v = k_buffer.to(device), v_buffer.to(device)
    store_kv_cache(got_k, got_v, loc.to(device), k.to(device), v.to(device))
    torch.testing.assert_close(got_k.cpu(), expected_k, atol=0, rtol=0)
    torch.testing.assert_close(got_v.cpu(), expected_v, atol=0, rtol=0)
    assert not torch.equal(expected_k, original_k)  # the case wrote something


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("tokens", "intermediate"), [(1, 64), (3, 1500)])
@pytest.mark.parametrize("act", sorted(GATED))
def test_silu_and_mul_interpret(dtype, tokens, intermediate, act):
    _check_silu_and_mul(device_for("interpret"), dtype, tokens, intermediate, act)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("tokens", "intermediate"), [(1, 14336), (100, 1536), (7, 1000)])
@pytest.mark.parametrize("act", sorted(GATED))
def test_silu_and_mul_gpu(dtype, tokens, intermediate, act):
    _check_silu_and_mul(device_for("gpu"), dtype, tokens, intermediate, act)


def test_gelu_tanh_ref_is_transformers_gelu_pytorch_tanh():
    from transformers.activations import ACT2FN

    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    gate, up = x.chunk(2, dim=-1)
    want = ACT2FN["gelu_pytorch_tanh"](gate) * up
    torch.testing.assert_close(gelu_tanh_and_mul_ref(x), want, atol=0, rtol=0)


@pytest.mark.interpret
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    ("dtype", "num_heads", "head_dim"), [(torch.bfloat16, 3, 64), (torch.float32, 2, 80)]
)
def test_store_kv_cache_interpret(loc_dtype, dtype, num_heads, head_dim):
    _check_store_kv(device_for("interpret"), dtype, loc_dtype, 5, num_heads, head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("tokens", "num_heads", "head_dim"), [(1, 8, 128), (300, 8, 128), (17, 3, 64), (9, 32, 96)]
)
def test_store_kv_cache_gpu(loc_dtype, dtype, tokens, num_heads, head_dim):
    _check_store_kv(device_for("gpu"), dtype, loc_dtype, tokens, num_heads, head_dim)
