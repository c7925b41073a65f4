"""The Triton kernels over an FP8 KV cache (``--kv-cache-dtype fp8_e4m3 | fp8_e5m2``)
against their torch references: the store rounds ``x / scale`` to FP8 byte for byte (values
beyond the format saturate); decode (table) and extend attention read ``stored * scale``,
the extend's new tokens passed as stored FP8 too (as the triton backend passes them). The
scales are not 1, and differ between K and V, so a scale applied to the wrong side shows.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import ATTENTION_TOLERANCE, device_for, indptr, paged_slots

from kvflow.kernels import (
    decode_attention_table_fwd,
    decode_attention_table_ref,
    extend_attention_fwd,
    extend_attention_ref,
    quantize_kv,
    store_kv_cache,
    store_kv_cache_ref,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, FP32 = torch.bfloat16, torch.float32
K_SCALE, V_SCALE = 0.37, 1.9


def _check_store(device, kv_dtype, dtype, tokens, num_heads, head_dim, scales, rounding=True):
    """``rounding`` False: inputs FP8 values times power-of-two scales, so nothing rounds
    (Triton 3.9's interpreter rounds float32 to FP8 wrongly: 7.9 to 4.0 where the exponent
    carries, ties away from even; compiled kernels round to nearest even, as torch)."""
    gen = torch.Generator().manual_seed(tokens + head_dim)
    num_slots = 2 * tokens + 3
    k = torch.randn(tokens, num_heads, head_dim, generator=gen) * 4
    v = torch.randn(tokens, num_heads, head_dim, generator=gen)
    if not rounding:
        k = k.to(kv_dtype).float() * scales[0]
        v = v.to(kv_dtype).float() * scales[1]
    k, v = k.to(dtype), v.to(dtype)
    k[0, 0, :2] = torch.tensor([1e5, -1e5]).to(dtype)  # saturate, not inf/NaN
    loc = torch.randperm(num_slots, generator=gen)[:tokens]
    want_k = torch.zeros(num_slots, num_heads, head_dim, dtype=kv_dtype)
    want_v = torch.zeros_like(want_k)
    store_kv_cache_ref(want_k, want_v, loc, k, v, *scales)
    got_k, got_v = torch.zeros_like(want_k).to(device), torch.zeros_like(want_v).to(device)
    store_kv_cache(got_k, got_v, loc.to(device), k.to(device), v.to(device), *scales)
    assert torch.equal(got_k.cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.cpu().view(torch.uint8), want_v.view(torch.uint8))
    assert want_k.float().isfinite().all() and want_k.view(torch.uint8).any()


def _fp8_pool(gen, shape, kv_dtype, scale):
    return quantize_kv(torch.randn(*shape, generator=gen), scale, kv_dtype)


def _check_decode(device, kv_dtype, dtype, num_kv_heads, group, head_dim, lengths, splits):
    gen = torch.Generator().manual_seed(sum(lengths) + head_dim)
    num_slots, rows = sum(lengths) + 16, len(lengths) + 2
    k_buffer = _fp8_pool(gen, (num_slots, num_kv_heads, head_dim), kv_dtype, K_SCALE)
    v_buffer = _fp8_pool(gen, (num_slots, num_kv_heads, head_dim), kv_dtype, V_SCALE)
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    table = torch.zeros(rows, max(lengths) + 3, dtype=torch.int32)
    req_rows = torch.randperm(rows, generator=gen)[: len(lengths)]
    slots = paged_slots(lengths, 1, num_slots, gen).split(lengths)
    for row, row_slots in zip(req_rows.tolist(), slots, strict=True):
        table[row, : row_slots.numel()] = row_slots
    seq_lens = torch.tensor(lengths)
    scale = head_dim**-0.5
    expected = decode_attention_table_ref(
        q, k_buffer, v_buffer, table, req_rows, seq_lens, scale,
        k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    out = torch.full_like(q, float("nan")).to(device)
    decode_attention_table_fwd(
        q.to(device), k_buffer.to(device), v_buffer.to(device), out, table.to(device),
        req_rows.to(device), seq_lens.to(device), scale, num_kv_splits=splits,
        k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu(), expected, **ATTENTION_TOLERANCE[dtype])


def _check_extend(device, kv_dtype, dtype, num_kv_heads, group, head_dim, prefixes, extends):
    gen = torch.Generator().manual_seed(sum(prefixes) + sum(extends))
    num_slots, total = sum(prefixes) + 8, sum(extends)
    k_buffer = _fp8_pool(gen, (num_slots, num_kv_heads, head_dim), kv_dtype, K_SCALE)
    v_buffer = _fp8_pool(gen, (num_slots, num_kv_heads, head_dim), kv_dtype, V_SCALE)
    k = _fp8_pool(gen, (total, num_kv_heads, head_dim), kv_dtype, K_SCALE)
    v = _fp8_pool(gen, (total, num_kv_heads, head_dim), kv_dtype, V_SCALE)
    q = torch.randn(total, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    qo_indptr, kv_indptr = indptr(extends), indptr(prefixes)
    kv_indices = paged_slots(prefixes, 1, num_slots, gen)
    scale = head_dim**-0.5
    args = (qo_indptr, kv_indptr, kv_indices)
    expected = extend_attention_ref(
        q, k, v, k_buffer, v_buffer, *args, scale, k_scale=K_SCALE, v_scale=V_SCALE
    )
    out = torch.full_like(q, float("nan")).to(device)
    extend_attention_fwd(
        q.to(device), k.to(device), v.to(device), out, k_buffer.to(device), v_buffer.to(device),
        *(t.to(device) for t in args), max(extends), scale, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu(), expected, **ATTENTION_TOLERANCE[dtype])


@pytest.mark.interpret
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_store_fp8_interpret(kv_dtype):
    _check_store(device_for("interpret"), kv_dtype, BF16, 5, 3, 64, (0.5, 4.0), rounding=False)


@pytest.mark.interpret
@pytest.mark.parametrize(("kv_dtype", "dtype"), [(E4M3, BF16), (E5M2, FP32)])
def test_decode_fp8_interpret(kv_dtype, dtype):
    _check_decode(device_for("interpret"), kv_dtype, dtype, 2, 4, 32, [40, 3, 17], 2)


@pytest.mark.interpret
@pytest.mark.parametrize(("kv_dtype", "dtype"), [(E4M3, BF16), (E5M2, FP32)])
def test_extend_fp8_interpret(kv_dtype, dtype):
    _check_extend(device_for("interpret"), kv_dtype, dtype, 2, 2, 32, [21, 0], [20, 7])


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, FP32])
@pytest.mark.parametrize(("tokens", "num_heads", "head_dim"), [(1, 8, 128), (300, 8, 128)])
def test_store_fp8_gpu(kv_dtype, dtype, tokens, num_heads, head_dim):
    scales = (K_SCALE, V_SCALE)
    _check_store(device_for("gpu"), kv_dtype, dtype, tokens, num_heads, head_dim, scales)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("splits", [None, 1])
def test_decode_fp8_gpu(kv_dtype, dtype, splits):
    _check_decode(device_for("gpu"), kv_dtype, dtype, 8, 4, 128, [1, 17, 1000, 3000], splits)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_extend_fp8_gpu(kv_dtype, dtype):
    _check_extend(device_for("gpu"), kv_dtype, dtype, 8, 4, 128, [0, 300, 1], [500, 37, 129])
