"""The native CPU row-wise kernels against the torch references the model uses elsewhere."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import (
    build_cos_sin_cache,
    rmsnorm_ref,
    rotary_embedding_ref,
    silu_and_mul_ref,
    store_kv_cache_ref,
)
from kvflow.kernels.cpu import available, elementwise

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler for the native kernels")
DTYPES = [torch.float32, torch.bfloat16]
# float32: the same math in another order; bfloat16: at most one rounding step apart
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2},
}


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576: over the parallel threshold
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm(dtype, rows, with_residual) -> None:
    x = _randn(rows, 576, dtype=dtype)
    weight = _randn(576, dtype=dtype, seed=1)
    residual = _randn(rows, 576, dtype=dtype, seed=2) if with_residual else None
    before = None if residual is None else residual.clone()
    got = elementwise.rmsnorm(x, weight, 1e-5, residual)
    want = rmsnorm_ref(x, weight, 1e-5, residual)
    if residual is None:
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    else:
        torch.testing.assert_close(got[0], want[0], **TOLERANCE[dtype])
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the sum is exact
        assert torch.equal(residual, before)  # inputs untouched


def test_rmsnorm_reads_strided_rows() -> None:
    wide = _randn(5, 128, dtype=torch.float32)
    x = wide[:, :64]
    weight = _randn(64, dtype=torch.float32, seed=1)
    torch.testing.assert_close(elementwise.rmsnorm(x, weight, 1e-6), rmsnorm_ref(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 40, 1000])
def test_rotary_in_place_on_qkv_views(dtype, tokens) -> None:
    heads, kv_heads, dim = 9, 3, 64
    table = build_cos_sin_cache(dim, 4096, 10000.0, None)
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(3))
    want_q, want_k = rotary_embedding_ref(positions, q, k, table, dim)
    v_before = v.clone()
    got_q, got_k = elementwise.rotary_embedding(positions, q, k, table, dim)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(got_q, want_q, **TOLERANCE[dtype])
    torch.testing.assert_close(got_k, want_k, **TOLERANCE[dtype])
    assert torch.equal(v, v_before)


def test_rotary_takes_flat_heads_like_the_triton_kernel() -> None:
    dim, table = 64, build_cos_sin_cache(64, 512, 10000.0, None)
    q, k = _randn(5, 9 * dim, dtype=torch.float32), _randn(5, 3 * dim, dtype=torch.float32, seed=1)
    positions = torch.arange(5)
    want_q, want_k = rotary_embedding_ref(positions, q, k, table, dim)
    got_q, got_k = elementwise.rotary_embedding(positions, q, k, table, dim)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    torch.testing.assert_close(got_q, want_q, **TOLERANCE[torch.float32])
    torch.testing.assert_close(got_k, want_k, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
def test_silu_and_mul(dtype, rows) -> None:
    x = _randn(rows, 2 * 1536, dtype=dtype) * 4
    torch.testing.assert_close(elementwise.silu_and_mul(x), silu_and_mul_ref(x), **TOLERANCE[dtype])


def test_refuses_other_dtypes_and_devices() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        elementwise.silu_and_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="bfloat16"):
        elementwise.rmsnorm(torch.zeros(2, 8), torch.zeros(8, dtype=torch.bfloat16), 1e-6)
    assert not elementwise.supports(torch.zeros(4, 4).t())


def test_rmsnorm_layer_falls_back_past_the_kernels_row_limit() -> None:
    from kvflow.runtime.layers import RMSNorm

    hidden = elementwise.MAX_HIDDEN + 64
    layer = RMSNorm(hidden, 1e-6)
    x = _randn(3, hidden, dtype=torch.float32)
    torch.testing.assert_close(layer(x), rmsnorm_ref(x, layer.weight, 1e-6))
    with pytest.raises(ValueError, match="not supported"):
        elementwise.rmsnorm(x, layer.weight, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 300])  # 300 rows x 3 heads x 64: the parallel path
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
def test_store_kv_matches_reference(dtype, tokens, loc_dtype) -> None:
    """K and V as the model produces them (column slices of the fused qkv projection)."""
    gen = torch.Generator().manual_seed(tokens)
    heads, dim = 3, 64
    k_buf = torch.randn(512, heads, dim, generator=gen).to(dtype)
    v_buf = torch.randn(512, heads, dim, generator=gen).to(dtype)
    qkv = torch.randn(tokens, 5 * heads * dim, generator=gen).to(dtype)
    k = qkv[:, 3 * heads * dim : 4 * heads * dim].view(tokens, heads, dim)
    v = qkv[:, 4 * heads * dim :].view(tokens, heads, dim)
    loc = torch.randperm(512, generator=gen)[:tokens].to(loc_dtype)
    want_k, want_v = k_buf.clone(), v_buf.clone()
    store_kv_cache_ref(want_k, want_v, loc, k, v)
    elementwise.store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)


def test_store_kv_refuses_mismatched_shapes() -> None:
    k_buf = torch.zeros(8, 2, 4)
    with pytest.raises(ValueError, match="agree"):
        elementwise.store_kv(
            k_buf, k_buf.clone(), torch.arange(2), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8)
        )
    with pytest.raises(ValueError, match="slots"):
        elementwise.store_kv(
            k_buf, k_buf.clone(), torch.arange(3), torch.zeros(2, 2, 4), torch.zeros(2, 2, 4)
        )
