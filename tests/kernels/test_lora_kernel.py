"""Segmented LoRA shrink/expand against their torch references: segments of mixed lengths,
adapters in any slot order, base-model segments (slot -1) left untouched."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import device_for, indptr

from kvflow.kernels import lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref

_TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def _check(device, dtype, lengths, slots, k, n, rank, num_slots=3, splits=None):
    gen = torch.Generator().manual_seed(sum(lengths) * 31 + k + n)
    tokens = sum(lengths)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    a = (torch.randn(num_slots, rank, k, generator=gen) * k**-0.5).to(dtype)
    b = (torch.randn(num_slots, n, rank, generator=gen) * rank**-0.5).to(dtype)
    base = torch.randn(tokens, n, generator=gen).to(dtype)
    seg_indptr = indptr(lengths)
    seg_slots = torch.tensor(slots, dtype=torch.int32)
    h_ref = lora_shrink_ref(x.double(), a.double(), seg_indptr, seg_slots)
    want = lora_expand_ref(h_ref, b.double(), base.double().clone(), seg_indptr, seg_slots)
    max_len = max(lengths)
    on = [t.to(device) for t in (x, a, b, seg_indptr, seg_slots)]
    h = lora_shrink(on[0], on[1], on[3], on[4], max_len, splits)
    out = base.to(device).clone()
    got = lora_expand(h, on[2], out, on[3], on[4], max_len)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    tol = _TOLERANCE[dtype]
    torch.testing.assert_close(h.cpu().double(), h_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(got.cpu().double(), want, atol=tol * 4, rtol=tol * 4)
    bounds = seg_indptr.tolist()
    for start, end, slot in zip(bounds, bounds[1:], slots, strict=False):
        if slot < 0:  # base-model rows: exactly as they were
            assert torch.equal(got[start:end].cpu(), base[start:end])


_CASES = [
    # (segment lengths, their slots): prefill segments, decode rows, base rows between
    ([5, 1, 17, 3], [2, -1, 0, 2]),
    ([1, 1, 1, 1, 1], [0, 1, -1, 2, 0]),
    ([40], [1]),
]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lengths", "slots"), _CASES)
def test_lora_segments_interpret(dtype, lengths, slots):
    _check(device_for("interpret"), dtype, lengths, slots, k=48, n=40, rank=24)


@pytest.mark.interpret
@pytest.mark.parametrize("splits", [2, 3, 4])
def test_lora_split_k_interpret(splits):
    """Split over K (K = 200 in blocks of 64: 2 splits of 128 + 72 columns, or 4 of 64, the
    last partly masked): the summed partials equal the unsplit products, and rows of
    segments without a slot stay zero."""
    lengths, slots = [5, 1, 17, 3], [2, -1, 0, 2]
    _check(device_for("interpret"), torch.float32, lengths, slots, 200, 40, 24, splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("lengths", "slots"), [*_CASES, ([300, 1, 129, 1, 1], [3, 0, -1, 1, 3])])
@pytest.mark.parametrize(
    ("k", "n", "rank"), [(4096, 6144, 48), (4096, 4096, 16), (14336, 4096, 64)]
)
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_lora_segments_gpu(dtype, lengths, slots, k, n, rank, splits):
    _check(device_for("gpu"), dtype, lengths, slots, k, n, rank, num_slots=4, splits=splits)


def test_lora_ref_leaves_base_rows():
    x, a, b = torch.ones(3, 4), torch.ones(1, 2, 4), torch.ones(1, 5, 2)
    seg_indptr, seg_slots = indptr([2, 1]), torch.tensor([-1, 0], dtype=torch.int32)
    out = lora_expand_ref(
        lora_shrink_ref(x, a, seg_indptr, seg_slots), b, torch.zeros(3, 5), seg_indptr, seg_slots
    )
    assert out[:2].abs().sum() == 0 and torch.all(out[2] == 8)
