"""Fused mixture-of-experts: each token's ``top_k`` SwiGLU experts as two grouped GEMMs.

The shape of SGLang's ``fused_moe_triton`` (after vLLM's): the (token, expert) pairs are
sorted by expert and each expert's run padded to a multiple of ``BLOCK_M``
(:func:`moe_align_block_size`), so every block of ``BLOCK_M`` sorted pairs belongs to one
expert; one Triton program multiplies such a block of rows by a ``BLOCK_N`` slice of that
expert's weight. Two launches do a layer::

    hidden [T, H] --gather rows, x w13[e].T--> [T * top_k, 2I] --silu_and_mul--> [T * top_k, I]
        --x w2[e].T, times the pair's routing weight--> [T * top_k, H] --sum over k--> [T, H]

Up to :data:`MOE_SMALL_BATCH_MAX_PAIRS` pairs (decode) skip the sort: ``fused_moe_small.py``
runs each pair as a matrix-vector product over its expert's rows (the choice made on the
host from shapes). Nothing here reads a device value on the host, so a CUDA graph captures
either path whatever the routing of the captured batch. Weights are ``[E, N, K]`` (rows contiguous, as the model
stacks them: ``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]``), in the activations' dtype or
FP8 with a scale per row or per block (:class:`ExpertScales`): FP8 weights are read as
bytes and converted in the kernel, activations stay in their dtype (W8A16).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvflow.kernels._launch import dot_precision, is_interpreted
from kvflow.kernels.fused_moe_small import fused_moe_small_batch

__all__ = [
    "MOE_SMALL_BATCH_MAX_PAIRS",
    "AlignedPairs",
    "ExpertScales",
    "fused_moe",
    "fused_moe_ref",
    "moe_align_block_size",
]

# NOTE: (token, expert) pairs up to which fused_moe skips the sort (Qwen3-MoE's top 8:
# batch 8). Each pair then reads its expert's weights whole, where the grouped path reads
# each routed expert once; not tuned on a GPU yet (benchmarks/bench_experts.py times both).
MOE_SMALL_BATCH_MAX_PAIRS = 64


class AlignedPairs(NamedTuple):
    """Pairs sorted by expert, each expert's run padded to a multiple of ``block_m``.

    ``sorted_ids`` ``[capacity]`` int32: pair indices (``token * top_k + k``), padding slots
    hold ``num_pairs``; ``expert_ids`` ``[capacity // block_m]`` int32: the expert of each
    block; ``num_padded`` ``[1]`` int32: the used length (blocks past it are skipped)."""

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> AlignedPairs:
    """Sort the pairs of ``topk_ids`` ``[T, top_k]`` by expert (stable: token order within
    an expert) into runs padded to ``block_m``; torch ops only, no host sync."""
    device = topk_ids.device
    flat = topk_ids.flatten().to(torch.int64)
    num_pairs = flat.numel()
    capacity = num_pairs + num_experts * (block_m - 1)
    capacity = triton.cdiv(capacity, block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = padded.cumsum(0)
    run_start = run_end - padded
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    first_of_expert = counts.cumsum(0) - counts  # unpadded position of each run's first pair
    rank = torch.arange(num_pairs, device=device) - first_of_expert[experts_sorted]
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[run_start[experts_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    expert_ids = torch.searchsorted(run_end, block_starts, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    num_padded = run_end[-1:].to(torch.int32)
    return AlignedPairs(sorted_ids, expert_ids, num_padded)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, weights_ptr, s_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, num_pairs, a_rows_per_pair,
    stride_am, stride_we, stride_wn, stride_cm,
    stride_se, stride_sn, stride_sk, group_n, group_k,
    MUL_WEIGHT: tl.constexpr, SCALES: tl.constexpr,
    UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``c[pair, n] = a[row(pair)] . w[expert, n]`` (times ``weights[pair]``) for one block
    of ``BLOCK_M`` sorted pairs and ``BLOCK_N`` output columns; ``row(pair)`` is
    ``pair // a_rows_per_pair`` (the token, for the first GEMM) or the pair itself.

    ``SCALES`` 0: ``w`` in ``a``'s dtype. 1: FP8 ``w`` with a scale per row ``s[e, n]``,
    applied to the float32 sum. 2: FP8 ``w`` with a scale per ``group_n x group_k`` block
    ``s[e, n // group_n, k // group_k]``, applied to each step's float32 partial sum
    (``BLOCK_K`` divides ``group_k``, so a step lies in one block column). FP8 values
    convert exactly to ``a``'s dtype (W8A16: the activations are not quantized)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    valid = pairs < num_pairs
    rows = (pairs // a_rows_per_pair).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_ptrs = s_ptr + expert * stride_se + (offs_n // group_n) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start_k in range(0, K, BLOCK_K):
        mask_k = start_k + offs_k < K
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST_DOT:  # NOTE: Triton's CPU interpreter has no bf16 dot
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        elif SCALES != 0:
            w = w.to(a.dtype)
        if SCALES == 2:
            block_scale = tl.load(s_ptrs + (start_k // group_k) * stride_sk, mask=mask_n, other=0.0)
            part = tl.dot(a, w, input_precision=PRECISION)
            acc += part * block_scale[None, :]
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALES == 1:
        acc = acc * tl.load(s_ptrs, mask=mask_n, other=0.0)[None, :]
    if MUL_WEIGHT:
        routed = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
        acc = acc * routed[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small when each expert gets few pairs (decode), larger for prefill."""
    per_expert = num_pairs / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


class ExpertScales(NamedTuple):
    """FP8 weight scales of one stacked expert projection ``w`` ``[E, N, K]``: ``scale``
    float32 ``[E, N]`` (one per row) when ``block_size`` is None, else ``[E, ceil(N / bn),
    ceil(K / bk)]`` (one per ``block_size`` = (bn, bk) block; ``bk`` a power of two >= 16,
    ``bn`` may be 1: a block scale expanded to rows)."""

    scale: torch.Tensor
    block_size: tuple[int, int] | None = None


def _grouped_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    aligned: AlignedPairs,
    block_m: int,
    num_pairs: int,
    a_rows_per_pair: int,
    routed: torch.Tensor | None,
    scales: ExpertScales | None,
) -> None:
    n, k = weight.shape[1], weight.shape[2]
    block_n, block_k = 64, 64 if k >= 64 else 32
    mode, group_n, group_k, scale_strides = 0, 1, 1, (0, 0, 0)
    scale = scales.scale if scales is not None else out
    if scales is not None:
        mode = 1 if scales.block_size is None else 2
        if scales.block_size is not None:
            group_n, group_k = scales.block_size
            block_k = min(block_k, group_k)
        strides = scale.stride()
        scale_strides = (strides[0], strides[1], strides[2] if mode == 2 else 0)
    interpreted = is_interpreted(_grouped_gemm_kernel)
    grid = (aligned.expert_ids.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, weight, out, routed if routed is not None else out, scale,
        aligned.sorted_ids, aligned.expert_ids, aligned.num_padded,
        n, k, num_pairs, a_rows_per_pair,
        a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        *scale_strides, group_n, group_k,
        MUL_WEIGHT=routed is not None, SCALES=mode, UPCAST_DOT=interpreted,
        PRECISION="ieee" if interpreted else dot_precision(a.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
    )  # fmt: skip


def _check_scales(name: str, weight: torch.Tensor, scales: ExpertScales | None) -> None:
    """ValueError (one line) where ``scales`` do not fit ``weight`` (shapes only: no sync)."""
    if scales is None:
        if weight.element_size() == 1:
            raise ValueError(f"{name}: an FP8 weight needs its scales")
        return
    experts, n, k = weight.shape
    if scales.block_size is None:
        expected: tuple[int, ...] = (experts, n)
    else:
        bn, bk = scales.block_size
        if bk < 16 or bk & (bk - 1):
            raise ValueError(f"{name}: block columns {bk} are not a power of two >= 16")
        expected = (experts, -(-n // bn), -(-k // bk))
    if tuple(scales.scale.shape) != expected or scales.scale.dtype != torch.float32:
        raise ValueError(
            f"{name}: scales {tuple(scales.scale.shape)} {scales.scale.dtype} for weight "
            f"{tuple(weight.shape)} with blocks {scales.block_size}: expected {expected} float32"
        )


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scales: ExpertScales | None = None,
    w2_scales: ExpertScales | None = None,
    small_batch: bool | None = None,
) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t])``, the expert being
    ``w2[e] @ silu_and_mul(w13[e] @ x)``: ``hidden`` ``[T, H]`` -> ``[T, H]`` in its dtype.
    ``w13`` ``[E, 2I, H]`` (gate rows, then up), ``w2`` ``[E, H, I]``, both contiguous,
    in ``hidden``'s dtype or FP8 (``float8_e4m3fn``) with their :class:`ExpertScales`
    (W8A16: the weights are converted to ``hidden``'s dtype in the kernel, exactly, and
    the scales applied to float32 sums). ``small_batch`` picks the path (None: the
    small-batch one up to :data:`MOE_SMALL_BATCH_MAX_PAIRS` pairs, else the grouped one)."""
    from kvflow.kernels.activation import silu_and_mul

    _check_scales("w13", w13, w13_scales)
    _check_scales("w2", w2, w2_scales)

    tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    if small_batch if small_batch is not None else num_pairs <= MOE_SMALL_BATCH_MAX_PAIRS:
        return fused_moe_small_batch(hidden, w13, w2, topk_weights, topk_ids, w13_scales, w2_scales)
    block_m = _block_m(num_pairs, num_experts)
    aligned = moe_align_block_size(topk_ids, block_m, num_experts)
    gate_up = torch.empty((num_pairs, two_inter), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, gate_up, aligned, block_m, num_pairs, top_k, None, w13_scales)
    act = silu_and_mul(gate_up)
    down = torch.empty((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    routed = topk_weights.to(torch.float32).flatten().contiguous()
    _grouped_gemm(act, w2, down, aligned, block_m, num_pairs, 1, routed, w2_scales)
    return down.view(tokens, top_k, hidden_size).sum(dim=1)


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Pure-torch :func:`fused_moe`, one token and expert at a time (for tests), in fp32."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for t in range(hidden.shape[0]):
        x = hidden[t].float()
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate, up = (w13[e].float() @ x).chunk(2)
            act = torch.nn.functional.silu(gate) * up
            out[t] += topk_weights[t, k].float() * (w2[e].float() @ act)
    return out.to(hidden.dtype)
