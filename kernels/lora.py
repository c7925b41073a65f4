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
segment, and one program per block would walk all of ``K`` alone (12-49 us a projection on
an H200, against 2.5-5 us split). It is split over ``K`` (split-K, as Punica's and SGLang's
shrink kernels): ``S`` programs per block write float32 partial products ``[S, T, R]``,
summed in a fixed order by a small kernel (deterministic, no atomics). Once per projection:
summing them inside the expand re-read them once per output column block.
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

__all__ = ["lora_expand", "lora_expand_ref", "lora_shrink", "lora_shrink_ref"]

_MIN_K_PER_SPLIT = 256  # a split's share of K: below this the partials cost more than it saves
_MAX_SPLITS = 16


# NOTE: the token count enters only through strides and sizes that vary every step: not
# specialized on, so a new batch size compiles nothing
@triton.jit(do_not_specialize=["stride_os"])
def _segment_gemm_kernel(
    x_ptr, w_ptr, out_ptr, seg_indptr_ptr, seg_slots_ptr,
    N, K, K_PER_SPLIT, stride_xm, stride_ws, stride_wn, stride_os, stride_om,
    ACCUMULATE: tl.constexpr, UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``out[split, rows of g] (+)= x[rows of g, k of split] @ w[slot_g, :, k of split].T``
    for one (row block, column block) of segment ``g = program_id(1)`` and K split
    ``split = program_id(2)`` (``K_PER_SPLIT`` columns each, a multiple of ``BLOCK_K``);
    ``w`` is ``[slots, N, K]`` with K contiguous. A segment without a slot: zeros written
    (``ACCUMULATE`` false), or its rows left alone."""
    seg = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(seg_slots_ptr + seg)
    start = tl.load(seg_indptr_ptr + seg)
    end = tl.load(seg_indptr_ptr + seg + 1)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // num_n_blocks
    pid_n = tl.program_id(0) % num_n_blocks
    if start + pid_m * BLOCK_M < end:
        offs_m = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < end
        mask_n = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if slot >= 0:
            offs_k = split * K_PER_SPLIT + tl.arange(0, BLOCK_K)
            x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
            w_ptrs = (
                w_ptr + slot.to(tl.int64) * stride_ws
                + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
            )  # fmt: skip
            for step_k in range(0, K_PER_SPLIT, BLOCK_K):  # one trip count in every split
                mask_k = offs_k + step_k < K
                x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
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
            if slot >= 0:
                acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["numel"])
def _sum_splits_kernel(partials_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i] = sum over s of partials[s * numel + i]`` (in order, float32)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLITS):
        acc += tl.load(partials_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weights: torch.Tensor, seg_indptr: torch.Tensor) -> None:
    if x.dim() != 2 or weights.dim() != 3 or x.shape[1] != weights.shape[2]:
        raise ValueError(f"x [T, K] and weights [slots, N, K], got {x.shape}, {weights.shape}")
    if x.stride(1) != 1 or weights.stride(2) != 1:
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
    """K splits for a grid of ``programs`` (row block x column block x segment): a power of
    two (few distinct kernels to compile) filling the device about twice over, each split
    keeping >= ``_MIN_K_PER_SPLIT`` of K."""
    if not x.is_cuda:
        return 1
    want = triton.cdiv(2 * multiprocessor_count(x.device.index or 0), programs)
    most = min(_MAX_SPLITS, k // max(block_k, _MIN_K_PER_SPLIT))
    return max(1, min(next_power_of_2(want), most))


def _launch(
    x: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    k_per_split: int | None,
    accumulate: bool,
) -> None:
    """``out``: ``[splits, T, N]`` or ``[T, N]``; ``k_per_split`` None: one split of all K."""
    n, k = weights.shape[1], weights.shape[2]
    block_m, block_n, block_k = _blocks(max_seg_len, n, k)
    if k_per_split is None:
        k_per_split = triton.cdiv(k, block_k) * block_k
    grid = (
        triton.cdiv(max_seg_len, block_m) * triton.cdiv(n, block_n),
        seg_slots.shape[0],
        triton.cdiv(k, k_per_split),
    )
    interpreted = is_interpreted(_segment_gemm_kernel)
    _segment_gemm_kernel[grid](
        x, weights, out, seg_indptr, seg_slots,
        n, k, k_per_split, x.stride(0), weights.stride(0), weights.stride(1),
        out.stride(0) if out.dim() == 3 else 0, out.stride(-2),
        ACCUMULATE=accumulate, UPCAST_DOT=interpreted,
        PRECISION="ieee" if interpreted else dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


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
    rows (known on the host, so the grid needs no device read). ``splits``: how many parts
    of K run in parallel (forced in tests; None: chosen for the device's size)."""
    _check(x, a_weights, seg_indptr)
    rank, k = a_weights.shape[1], a_weights.shape[2]
    h = torch.empty((x.shape[0], rank), dtype=x.dtype, device=x.device)
    if seg_slots.shape[0] == 0 or max_seg_len == 0:
        return h.zero_()
    block_m, block_n, block_k = _blocks(max_seg_len, rank, k)
    if splits is None:
        programs = triton.cdiv(max_seg_len, block_m) * triton.cdiv(rank, block_n)
        splits = _num_splits(x, programs * seg_slots.shape[0], k, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, max(1, splits)), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)  # (rounding to whole blocks may leave fewer)
    if splits == 1:
        _launch(x, a_weights, h, seg_indptr, seg_slots, max_seg_len, k_per_split, False)
        return h
    partials = torch.empty((splits, *h.shape), dtype=torch.float32, device=x.device)
    _launch(x, a_weights, partials, seg_indptr, seg_slots, max_seg_len, k_per_split, False)
    block = 1024
    _sum_splits_kernel[(triton.cdiv(h.numel(), block),)](
        partials, h, h.numel(), SPLITS=splits, BLOCK=block
    )
    return h


def lora_expand(
    h: torch.Tensor,
    b_weights: torch.Tensor,
    out: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """``out[rows of g] += h[rows of g] @ b_weights[slot_g].T`` in place (``h`` ``[T, R]``,
    ``b_weights`` ``[slots, N, R]``, ``out`` ``[T, N]`` with rows of stride ``out.stride(0)``
    and contiguous columns); returns ``out``."""
    if out.stride(1) != 1 or out.shape != (h.shape[0], b_weights.shape[1]):
        raise ValueError(f"out must be [T, N] with contiguous columns, got {out.shape}")
    _check(h, b_weights, seg_indptr)
    if seg_slots.shape[0] == 0 or max_seg_len == 0:
        return out
    _launch(h, b_weights, out, seg_indptr, seg_slots, max_seg_len, None, True)
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
