"""Segmented LoRA matmuls (S-LoRA/Punica's SGMV, SGLang's ``lora/triton_ops``).

A batch's token rows come in segments (``seg_indptr``: CSR offsets, one segment per run of
requests on the same adapter); segment ``g`` uses adapter slot ``seg_slots[g]`` of the
stacked weights, or none when the slot is negative (the base model's rows). For one
projection with ``A`` ``[slots, R, K]`` and ``B`` ``[slots, N, R]`` (the scaling already
folded into ``B``), the LoRA delta is ``lora_expand(lora_shrink(x, A), B, out)``:

- :func:`lora_shrink`: ``h[rows of g] = x[rows of g] @ A[slot].T`` -> ``[T, R]``
  (zeros on the base model's rows);
- :func:`lora_expand`: ``out[rows of g] += h[rows of g] @ B[slot].T``, in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels._launch import dot_precision, is_interpreted, next_power_of_2

__all__ = ["lora_expand", "lora_expand_ref", "lora_shrink", "lora_shrink_ref"]


@triton.jit
def _segment_gemm_kernel(
    x_ptr, w_ptr, out_ptr, seg_indptr_ptr, seg_slots_ptr,
    N, K, stride_xm, stride_ws, stride_wn, stride_om,
    ACCUMULATE: tl.constexpr, UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``out[rows of g] (+)= x[rows of g] @ w[slot_g].T`` for one (row block, column block)
    of segment ``g = program_id(1)``; ``w`` is ``[slots, N, K]`` with K contiguous."""
    seg = tl.program_id(1)
    slot = tl.load(seg_slots_ptr + seg)
    start = tl.load(seg_indptr_ptr + seg)
    end = tl.load(seg_indptr_ptr + seg + 1)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // num_n_blocks
    pid_n = tl.program_id(0) % num_n_blocks
    if slot >= 0 and start + pid_m * BLOCK_M < end:
        offs_m = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < end
        mask_n = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = (
            w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :].to(tl.int64) * stride_wn
            + offs_k[:, None]
        )  # fmt: skip
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start_k in range(0, K, BLOCK_K):
            mask_k = start_k + offs_k < K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if UPCAST_DOT:  # NOTE: Triton's CPU interpreter has no bf16 dot
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if ACCUMULATE:
            acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weights: torch.Tensor, seg_indptr: torch.Tensor) -> None:
    if x.dim() != 2 or weights.dim() != 3 or x.shape[1] != weights.shape[2]:
        raise ValueError(f"x [T, K] and weights [slots, N, K], got {x.shape}, {weights.shape}")
    if x.stride(1) != 1 or weights.stride(2) != 1:
        raise ValueError("x and weights need a contiguous last dimension")
    if seg_indptr.dtype != torch.int32:
        raise ValueError("seg_indptr and seg_slots are int32")


def _segment_gemm(
    x: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    accumulate: bool,
) -> None:
    _check(x, weights, seg_indptr)
    num_segments = seg_slots.shape[0]
    n, k = weights.shape[1], weights.shape[2]
    if num_segments == 0 or max_seg_len == 0:
        return
    block_m = min(64, max(16, next_power_of_2(max_seg_len)))
    block_n = min(128, max(16, next_power_of_2(n)))
    block_k = min(64, max(16, next_power_of_2(k)))
    grid = (triton.cdiv(max_seg_len, block_m) * triton.cdiv(n, block_n), num_segments)
    _segment_gemm_kernel[grid](
        x, weights, out, seg_indptr, seg_slots,
        n, k, x.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        ACCUMULATE=accumulate, UPCAST_DOT=is_interpreted(_segment_gemm_kernel),
        PRECISION="ieee" if is_interpreted(_segment_gemm_kernel) else dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


def lora_shrink(
    x: torch.Tensor,
    a_weights: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """``x`` ``[T, K]``, ``a_weights`` ``[slots, R, K]`` -> ``[T, R]`` in ``x``'s dtype
    (zeros on rows of segments without a slot). ``max_seg_len``: the longest segment's
    rows (known on the host, so the grid needs no device read)."""
    h = torch.zeros((x.shape[0], a_weights.shape[1]), dtype=x.dtype, device=x.device)
    _segment_gemm(x, a_weights, h, seg_indptr, seg_slots, max_seg_len, accumulate=False)
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
    _segment_gemm(h, b_weights, out, seg_indptr, seg_slots, max_seg_len, accumulate=True)
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
