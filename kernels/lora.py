"""Segmented LoRA matmuls (S-LoRA/Punica's SGMV, SGLang's ``lora/triton_ops``).

A batch's token rows come in segments (``seg_indptr``: CSR offsets, one segment per run of
requests on the same adapter); segment ``g`` uses adapter slot ``seg_slots[g]`` of the
stacked weights, or none when the slot is negative (the base model's rows). For one
projection with ``A`` ``[slots, R, K]`` and ``B`` ``[slots, N, R]`` (the scaling already
folded into ``B``), the LoRA delta is ``lora_expand(lora_shrink(x, A), B, out)``:

- :func:`lora_shrink`: ``h[rows of g] = x[rows of g] @ A[slot].T`` -> ``[T, R]``
  (zeros on the base model's rows);
- :func:`lora_expand`: ``out[rows of g] += h[rows of g] @ B[slot].T``, in place.

The shrink's output is narrow (``R``: 16-192 columns) and its reduction wide (``K``: the
hidden or intermediate size), so a decode batch gives it one or two column blocks per
segment: one program per segment would walk all of ``K`` alone. It is split over ``K``
(split-K, as Punica's and SGLang's shrink kernels): each of ``S`` programs per block
writes a float32 partial product ``[S, T, R]``, and the expand sums the ``S`` partials as
it loads them (:func:`lora_shrink_partials`, in a fixed order: deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels._launch import (
    dot_precision,
    is_interpreted,
    multiprocessor_count,
    next_power_of_2,
)

__all__ = [
    "lora_expand",
    "lora_expand_ref",
    "lora_shrink",
    "lora_shrink_partials",
    "lora_shrink_ref",
]

_MIN_K_PER_SPLIT = 256  # a split's share of K: below this the partials cost more than it saves
_MAX_SPLITS = 16  # the expand unrolls one load per partial


@triton.jit
def _segment_gemm_kernel(
    x_ptr, w_ptr, out_ptr, seg_indptr_ptr, seg_slots_ptr,
    N, K, K_PER_SPLIT, stride_xs, stride_xm, stride_ws, stride_wn, stride_os, stride_om,
    IN_SPLITS: tl.constexpr, ACCUMULATE: tl.constexpr, UPCAST_DOT: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``out[split, rows of g] (+)= x[rows of g, k of split] @ w[slot_g, :, k of split].T``
    for one (row block, column block) of segment ``g = program_id(1)`` and K split
    ``split = program_id(2)`` (``K_PER_SPLIT`` columns each, a multiple of ``BLOCK_K``).
    ``w`` is ``[slots, N, K]`` with K contiguous; ``x`` is the sum of its ``IN_SPLITS``
    partials (``stride_xs`` apart, summed in float32 and cast to ``w``'s dtype)."""
    seg = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(seg_slots_ptr + seg)
    start = tl.load(seg_indptr_ptr + seg)
    end = tl.load(seg_indptr_ptr + seg + 1)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // num_n_blocks
    pid_n = tl.program_id(0) % num_n_blocks
    if slot >= 0 and start + pid_m * BLOCK_M < end:
        offs_m = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = split * K_PER_SPLIT + tl.arange(0, BLOCK_K)
        mask_m = offs_m < end
        mask_n = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = (
            w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :].to(tl.int64) * stride_wn
            + offs_k[:, None]
        )  # fmt: skip
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for step_k in range(0, K_PER_SPLIT, BLOCK_K):  # the same trip count in every split
            mask_k = offs_k + step_k < K
            x_mask = mask_m[:, None] & mask_k[None, :]
            x = tl.load(x_ptrs, mask=x_mask, other=0.0)
            w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if IN_SPLITS > 1:
                for s in tl.static_range(1, IN_SPLITS):
                    x += tl.load(x_ptrs + s * stride_xs, mask=x_mask, other=0.0)
                x = x.to(w.dtype)
            if UPCAST_DOT:  # NOTE: Triton's CPU interpreter has no bf16 dot
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out_ptrs = (
            out_ptr + split.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om
            + offs_n[None, :]
        )  # fmt: skip
        mask = mask_m[:, None] & mask_n[None, :]
        if ACCUMULATE:
            acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weights: torch.Tensor, seg_indptr: torch.Tensor) -> None:
    if x.dim() not in (2, 3) or weights.dim() != 3 or x.shape[-1] != weights.shape[2]:
        raise ValueError(f"x [T, K] and weights [slots, N, K], got {x.shape}, {weights.shape}")
    if x.stride(-1) != 1 or weights.stride(2) != 1:
        raise ValueError("x and weights need a contiguous last dimension")
    if seg_indptr.dtype != torch.int32:
        raise ValueError("seg_indptr and seg_slots are int32")


def _blocks(max_seg_len: int, n: int, k: int) -> tuple[int, int, int]:
    return (
        min(64, max(16, next_power_of_2(max_seg_len))),
        min(128, max(16, next_power_of_2(n))),
        min(64, max(16, next_power_of_2(k))),
    )


def _num_splits(x: torch.Tensor, programs: int, k: int, block_k: int) -> int:
    """K splits for a grid of ``programs`` (row block x column block x segment): enough
    programs to fill the device twice over, each keeping >= ``_MIN_K_PER_SPLIT`` of K."""
    if not x.is_cuda:
        return 1
    want = triton.cdiv(2 * multiprocessor_count(x.device.index or 0), programs)
    return max(1, min(want, _MAX_SPLITS, k // max(block_k, _MIN_K_PER_SPLIT)))


def _launch(
    x: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    splits: int,
    accumulate: bool,
) -> None:
    """``out`` is ``[splits, T, N]`` (``splits`` > 1) or ``[T, N]``; ``x`` ``[S, T, K]`` (the
    partials to sum) or ``[T, K]``."""
    n, k = weights.shape[1], weights.shape[2]
    block_m, block_n, block_k = _blocks(max_seg_len, n, k)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    grid = (
        triton.cdiv(max_seg_len, block_m) * triton.cdiv(n, block_n),
        seg_slots.shape[0],
        triton.cdiv(k, k_per_split),
    )
    in_splits = x.shape[0] if x.dim() == 3 else 1
    interpreted = is_interpreted(_segment_gemm_kernel)
    _segment_gemm_kernel[grid](
        x, weights, out, seg_indptr, seg_slots,
        n, k, k_per_split, x.stride(0) if in_splits > 1 else 0, x.stride(-2),
        weights.stride(0), weights.stride(1), out.stride(0) if out.dim() == 3 else 0,
        out.stride(-2),
        IN_SPLITS=in_splits, ACCUMULATE=accumulate, UPCAST_DOT=interpreted,
        PRECISION="ieee" if interpreted else dot_precision(weights.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        # NOTE: the expand's K is the rank (one or a few blocks): nothing to pipeline, and
        # staging each partial's tile in shared memory would not fit
        num_stages=1 if in_splits > 1 else 3,
    )  # fmt: skip


def lora_shrink_partials(
    x: torch.Tensor,
    a_weights: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    splits: int | None = None,
) -> torch.Tensor:
    """:func:`lora_shrink` split over ``K``: ``[S, T, R]`` float32 partial products whose
    sum over the first dimension is the shrink (rows of segments without a slot are left
    unwritten: :func:`lora_expand` skips them); ``[T, R]`` in ``x``'s dtype when one split
    suffices. ``splits``: forced (tests), else chosen for the device."""
    _check(x, a_weights, seg_indptr)
    rank, k = a_weights.shape[1], a_weights.shape[2]
    if seg_slots.shape[0] == 0 or max_seg_len == 0:
        return torch.zeros((x.shape[0], rank), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _blocks(max_seg_len, rank, k)
    if splits is None:
        programs = triton.cdiv(max_seg_len, block_m) * triton.cdiv(rank, block_n)
        splits = _num_splits(x, programs * seg_slots.shape[0], k, block_k)
    splits = min(splits, _MAX_SPLITS, triton.cdiv(k, block_k))
    if splits == 1:
        h = torch.zeros((x.shape[0], rank), dtype=x.dtype, device=x.device)
    else:
        # NOTE: k_per_split rounds up to BLOCK_K, so the grid may hold fewer splits
        splits = triton.cdiv(k, triton.cdiv(triton.cdiv(k, splits), block_k) * block_k)
        h = torch.empty((splits, x.shape[0], rank), dtype=torch.float32, device=x.device)
    _launch(x, a_weights, h, seg_indptr, seg_slots, max_seg_len, splits, accumulate=False)
    return h


def lora_shrink(
    x: torch.Tensor,
    a_weights: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    splits: int | None = None,
) -> torch.Tensor:
    """``x`` ``[T, K]``, ``a_weights`` ``[slots, R, K]`` -> ``[T, R]`` in ``x``'s dtype
    (zeros on rows of segments without a slot). ``max_seg_len``: the longest segment's
    rows (known on the host, so the grid needs no device read)."""
    h = lora_shrink_partials(x, a_weights, seg_indptr, seg_slots, max_seg_len, splits)
    if h.dim() == 2:
        return h
    summed = h.sum(0).to(x.dtype)
    rows = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    bounds, slots = seg_indptr.tolist(), seg_slots.tolist()
    for g, slot in enumerate(slots):
        rows[bounds[g] : bounds[g + 1]] = slot >= 0
    return summed.masked_fill_(~rows[:, None], 0)


def lora_expand(
    h: torch.Tensor,
    b_weights: torch.Tensor,
    out: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """``out[rows of g] += h[rows of g] @ b_weights[slot_g].T`` in place (``h`` ``[T, R]``,
    or ``[S, T, R]`` partials from :func:`lora_shrink_partials`, summed; ``b_weights``
    ``[slots, N, R]``, ``out`` ``[T, N]`` with rows of stride ``out.stride(0)`` and
    contiguous columns); returns ``out``."""
    rows = h.shape[-2]
    if out.stride(1) != 1 or out.shape != (rows, b_weights.shape[1]):
        raise ValueError(f"out must be [T, N] with contiguous columns, got {out.shape}")
    _check(h, b_weights, seg_indptr)
    if seg_slots.shape[0] == 0 or max_seg_len == 0:
        return out
    _launch(h, b_weights, out, seg_indptr, seg_slots, max_seg_len, 1, accumulate=True)
    return out


def _segments(seg_indptr: torch.Tensor, seg_slots: torch.Tensor) -> list[tuple[int, int, int]]:
    bounds = seg_indptr.tolist()
    return [(bounds[g], bounds[g + 1], s) for g, s in enumerate(seg_slots.tolist())]


def lora_shrink_ref(
    x: torch.Tensor, a_weights: torch.Tensor, seg_indptr: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    """Pure-torch :func:`lora_shrink` (one matmul per segment; the CPU path)."""
    h = x.new_zeros((x.shape[0], a_weights.shape[1]))
    for start, end, slot in _segments(seg_indptr, seg_slots):
        if slot >= 0 and end > start:
            h[start:end] = x[start:end] @ a_weights[slot].t()
    return h


def lora_expand_ref(
    h: torch.Tensor,
    b_weights: torch.Tensor,
    out: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
) -> torch.Tensor:
    """Pure-torch :func:`lora_expand` (in place on ``out``; the CPU path)."""
    for start, end, slot in _segments(seg_indptr, seg_slots):
        if slot >= 0 and end > start:
            out[start:end] += h[start:end] @ b_weights[slot].t()
    return out
