"""extend_attention_fwd against extend_attention_ref: prefix/no prefix, ragged, GQA, paged;
a sliding window, with the prefix tiles wholly before it poisoned (NaN) to show they are not
read; soft-capped scores (Gemma 2); q, k and v as views of one merged QKV output (no copy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import ATTENTION_TOLERANCE, device_for, indptr, paged_slots

from kvflow.kernels import extend_attention_fwd, extend_attention_ref


def _run_case(
    device, dtype, num_kv_heads, group, head_dim, prefix_lens, extend_lens, page_size,
    window=None, block_n=16, logit_cap=None, packed=False,
):  # fmt: skip
    gen = torch.Generator().manual_seed(sum(prefix_lens) * 13 + sum(extend_lens) + group)
    num_q_heads = num_kv_heads * group
    num_slots = (sum(-(-n // page_size) for n in prefix_lens) + 4) * page_size
    total = sum(extend_lens)
    k_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(total, num_q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    qo_indptr, kv_indptr = indptr(extend_lens), indptr(prefix_lens)
    kv_indices = paged_slots(prefix_lens, page_size, num_slots, gen)
    scale = head_dim**-0.5
    expected = extend_attention_ref(
        q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, scale, window, logit_cap
    )
    if logit_cap is not None:  # the cap must matter for these scores
        uncapped = extend_attention_ref(
            q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, scale, window
        )
        assert (uncapped.float() - expected.float()).abs().max() > 0.05
    if window is not None:  # tiles of block_n keys wholly before the first new token's window
        for prefix, slots in zip(prefix_lens, kv_indices.split(prefix_lens), strict=True):
            unread = slots[: max(0, prefix + 1 - window) // block_n * block_n].long()
            k_buffer[unread] = float("nan")
            v_buffer[unread] = float("nan")
        assert not expected.isnan().any()

    tensors = [t.to(device) for t in (q, k, v)]
    if packed:  # views of one [tokens, (q + 2 kv heads) * head_dim] row, as the QKV split's
        qkv = torch.cat([t.flatten(1) for t in tensors], dim=1)
        widths = [t.shape[1] * head_dim for t in tensors]
        tensors = [
            part.view(total, -1, head_dim) for part in qkv.split(widths, dim=1)
        ]  # fmt: skip
        assert not tensors[0].is_contiguous() and tensors[0].stride(-1) == 1
    out = torch.full((total, num_q_heads, head_dim), float("nan"), dtype=dtype, device=device)
    extend_attention_fwd(
        *tensors,
        out,
        k_buffer.to(device),
        v_buffer.to(device),
        qo_indptr.to(device),
        kv_indptr.to(device),
        kv_indices.to(device),
        max(extend_lens),
        scale,
        window,
        logit_cap,
    )
    torch.testing.assert_close(out.cpu(), expected, **ATTENTION_TOLERANCE[dtype])


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (dtype, num_kv_heads, group, head_dim, prefix_lens, extend_lens, page_size); interpreted
# kernels use 16 x 16 tiles, so these cross tile borders and the diagonal.
INTERPRET_CASES = [
    (BF16, 2, 1, 64, [0, 0], [5, 40], 1),  # no prefix: plain causal prefill
    (FP32, 2, 1, 64, [0, 0], [5, 40], 1),
    (BF16, 2, 4, 32, [21, 0, 40], [20, 7, 1], 16),
    (FP16, 2, 4, 32, [21, 0, 40], [20, 7, 1], 16),
    (BF16, 1, 8, 64, [50], [17], 4),
    (BF16, 2, 4, 80, [3, 19], [2, 20], 1),  # head_dim not a power of two
]


@pytest.mark.interpret
@pytest.mark.parametrize("case", INTERPRET_CASES)
def test_extend_attention_interpret(case):
    _run_case(device_for("interpret"), *case)


@pytest.mark.interpret
@pytest.mark.parametrize("window", [1, 5, 16, 33])
@pytest.mark.parametrize("case", INTERPRET_CASES[1:4])
def test_extend_attention_window_interpret(case, window):
    """Windows under, at and over a 16-key tile, with and without a cached prefix: rows of a
    block whose windows start in different tiles, rows with no key in a tile."""
    _run_case(device_for("interpret"), *case, window=window)


@pytest.mark.interpret
@pytest.mark.parametrize("window", [None, 5, 33])
@pytest.mark.parametrize("case", INTERPRET_CASES[1:4])
def test_extend_attention_softcap_interpret(case, window):
    """Scores soft-capped at 1.0 (scaled scores of these inputs reach about 4) in every
    tile kind: prefix, below the diagonal, diagonal; with and without a window."""
    _run_case(device_for("interpret"), *case, window=window, logit_cap=1.0)


GPU_CASES = [
    (8, 4, 128, [0], [1000], 1),
    (8, 4, 128, [0, 512, 1, 300], [129, 64, 300, 1], 16),
    (4, 1, 128, [1000, 0], [7, 513], 64),
    (2, 8, 64, [2000, 33, 5], [250, 1, 128], 1),
    (2, 4, 96, [100], [200], 8),
    (1, 8, 256, [64], [100], 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", GPU_CASES)
def test_extend_attention_gpu(dtype, case):
    _run_case(device_for("gpu"), dtype, *case)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", GPU_CASES[1:4])
def test_extend_attention_softcap_window_gpu(dtype, case):
    _run_case(device_for("gpu"), dtype, *case, window=100, block_n=64, logit_cap=1.0)


@pytest.mark.interpret
@pytest.mark.parametrize("case", INTERPRET_CASES[2:5])
def test_extend_attention_packed_qkv_interpret(case):
    """q, k, v as strided views of one merged QKV output: read in place, as the backend
    passes them (no copies)."""
    _run_case(device_for("interpret"), *case, packed=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(BF16, 8, 4, 128, [37, 0], [300, 129], 16)])
def test_extend_attention_packed_qkv_gpu(case):
    _run_case(device_for("gpu"), *case, packed=True)


def test_extend_attention_ref_matches_sdpa():
    """The reference itself, without a prefix, against torch's causal SDPA (CPU)."""
    gen = torch.Generator().manual_seed(2)
    extend_lens, kv_heads, group, head_dim = [6, 11], 2, 4, 32
    total = sum(extend_lens)
    q = torch.randn(total, kv_heads * group, head_dim, generator=gen)
    k = torch.randn(total, kv_heads, head_dim, generator=gen)
    v = torch.randn(total, kv_heads, head_dim, generator=gen)
    empty_pool = torch.zeros(1, kv_heads, head_dim)
    qo_indptr, kv_indptr = indptr(extend_lens), indptr([0, 0])
    no_slots = torch.zeros(0, dtype=torch.int32)
    out = extend_attention_ref(q, k, v, empty_pool, empty_pool, qo_indptr, kv_indptr, no_slots, 0.2)
    start = 0
    for length in extend_lens:
        rows = slice(start, start + length)
        start += length
        expected = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1),
            k[rows].transpose(0, 1),
            v[rows].transpose(0, 1),
            is_causal=True,
            scale=0.2,
            enable_gqa=True,
        )
        torch.testing.assert_close(out[rows], expected.transpose(0, 1), atol=1e-5, rtol=1e-5)
