"""Small-batch path of :func:`kvflow.kernels.fused_moe`: the (token, expert) pairs as
matrix-vector products, no sort.

At decode the grouped path's alignment (a dozen small torch launches) and its ``BLOCK_M``
tiles of mostly padding cost more than the weights they read. Here each program reads
its expert id from ``topk_ids`` and streams ``BLOCK_N`` rows of that expert's weight,
reducing over ``K`` in float32 as :func:`kvflow.kernels.gemv` does. Two launches::

    gate/up: grid (pair, block of I)   act[pair] = silu(x . gate rows) * (x . up rows)
    down:    grid (token, block of H)  out[t] = sum_k weight[t, k] * (act[t, k] . w2 rows)

The down kernel holds all ``top_k`` pairs of its token (a ``[TOP_K, BLOCK_N, BLOCK_K]``
tile), so the sum over ``k`` is one fixed-order reduction in registers: deterministic, no
atomics, no ``[T, top_k, H]`` intermediate. The pair (or token) is the fastest grid axis,
so programs in flight together read the same rows of every pair's expert and a repeated
expert is mostly served by L2. Grids depend on shapes only: capturable in a CUDA graph.
FP8 weights with per-row or block scales as in the grouped path (W8A16).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from kvflow.kernels._launch import is_interpreted, next_power_of_2

if TYPE_CHECKING:
    from kvflow.kernels.fused_moe import ExpertScales

__all__ = ["SmallBatchConfig", "fused_moe_small_batch"]


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, ids_ptr, act_ptr,
    inter, K, top_k,
    stride_xm, stride_we, stride_wn, stride_am,
    stride_se, stride_sn, stride_sk, group_n, group_k,
    SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``act[pair, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, inter + n])`` for
    ``BLOCK_N`` columns ``n``, ``e = ids[pair]``, ``token = pair // top_k``. ``SCALES`` as
    in the grouped kernel (0 none, 1 per row, 2 per block; ``BLOCK_K`` divides
    ``group_k``, so a step lies in one block column)."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    token = (pair // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * stride_xm + offs_k
    gate_rows = expert * stride_we + offs_n.to(tl.int64) * stride_wn
    gate_ptrs = w_ptr + gate_rows[:, None] + offs_k[None, :]
    up_ptrs = gate_ptrs + inter * stride_wn
    gate_s = s_ptr + expert * stride_se + (offs_n // group_n) * stride_sn
    up_s = s_ptr + expert * stride_se + ((offs_n + inter) // group_n) * stride_sn
    gate_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start_k in range(0, K, BLOCK_K):
        mask_k = start_k + offs_k < K
        mask = mask_n[:, None] & mask_k[None, :]
        x = tl.load(x_ptrs + start_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        gate = tl.load(gate_ptrs + start_k, mask=mask, other=0.0, eviction_policy="evict_first")
        up = tl.load(up_ptrs + start_k, mask=mask, other=0.0, eviction_policy="evict_first")
        gate = gate.to(tl.float32) * x
        up = up.to(tl.float32) * x
        if SCALES == 2:
            column = (start_k // group_k) * stride_sk
            gate = gate * tl.load(gate_s + column, mask=mask_n, other=0.0)[:, None]
            up = up * tl.load(up_s + column, mask=mask_n, other=0.0)[:, None]
        gate_acc += gate
        up_acc += up
    gate_sum = tl.sum(gate_acc, axis=1)
    up_sum = tl.sum(up_acc, axis=1)
    if SCALES == 1:
        gate_sum = gate_sum * tl.load(gate_s, mask=mask_n, other=0.0)
        up_sum = up_sum * tl.load(up_s, mask=mask_n, other=0.0)
    act = gate_sum * tl.sigmoid(gate_sum) * up_sum
    act_ptrs = act_ptr + pair.to(tl.int64) * stride_am + offs_n
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, s_ptr, ids_ptr, weights_ptr, out_ptr,
    N, K, top_k,
    stride_am, stride_we, stride_wn, stride_om,
    stride_se, stride_sn, stride_sk, group_n, group_k,
    SCALES: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``out[token, n] = sum_k weights[pair] * (act[pair] . w[ids[pair], n])`` over the
    token's pairs ``pair = token * top_k + k`` (``TOP_K``: ``top_k`` padded to a power of
    two, the padding masked), for ``BLOCK_N`` columns ``n``; scales as above."""
    token = tl.program_id(0)
    offs_j = tl.arange(0, TOP_K)
    mask_j = offs_j < top_k
    pairs = (token * top_k + offs_j).to(tl.int64)
    experts = tl.load(ids_ptr + pairs, mask=mask_j, other=0).to(tl.int64)
    routed = tl.load(weights_ptr + pairs, mask=mask_j, other=0.0).to(tl.float32)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = experts[:, None] * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    w_ptrs = w_ptr + rows[:, :, None] + offs_k[None, None, :]
    a_ptrs = act_ptr + pairs[:, None, None] * stride_am + offs_k[None, None, :]
    mask_rows = mask_j[:, None] & mask_n[None, :]
    s_ptrs = s_ptr + experts[:, None] * stride_se + (offs_n // group_n)[None, :] * stride_sn
    acc = tl.zeros([TOP_K, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start_k in range(0, K, BLOCK_K):
        mask_k = (start_k + offs_k < K)[None, None, :]
        a = tl.load(a_ptrs + start_k, mask=mask_j[:, None, None] & mask_k, other=0.0)
        w = tl.load(
            w_ptrs + start_k, mask=mask_rows[:, :, None] & mask_k, other=0.0,
            eviction_policy="evict_first",
        )  # fmt: skip
        product = w.to(tl.float32) * a.to(tl.float32)
        if SCALES == 2:
            column = (start_k // group_k) * stride_sk
            product = product * tl.load(s_ptrs + column, mask=mask_rows, other=0.0)[:, :, None]
        acc += product
    per_pair = tl.sum(acc, axis=2)
    if SCALES == 1:
        per_pair = per_pair * tl.load(s_ptrs, mask=mask_rows, other=0.0)
    out = tl.sum(per_pair * routed[:, None], axis=0)
    out_ptrs = out_ptr + token.to(tl.int64) * stride_om + offs_n
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_n)


class SmallBatchConfig(NamedTuple):
    """Tile sizes of the two launches: each program streams ``2 * gate_up_n`` rows (gate
    and up) of ``gate_up_k`` columns per step, or ``top_k * down_n`` rows of ``down_k``.
    Column counts are capped at the reduced width (rounded up to a power of two) and,
    with block scales, at the block's; the rows then grow to keep the tile's size."""

    gate_up_n: int = 2
    gate_up_k: int = 512
    down_n: int = 2
    down_k: int = 256
    num_warps: int = 4


# NOTE: swept on an H200 (benchmarks/bench_experts.py, Qwen3-30B-A3B's experts in a CUDA
# graph, 13 tile configurations): 1 row x 1024 columns for gate/up and top-8 x 1 row x 128
# for down was fastest at every batch the path serves: 25.8 / 82.8 / 152 us at batch 1 / 4
# / 8 (61% / 69% / 66% of HBM bandwidth), against 32.7 / 92.5 / 166 us for the unswept
# 2 x 512 and 2 x 256 tiles (benchmarks/results/models.md).
DEFAULT_CONFIG = SmallBatchConfig(gate_up_n=1, gate_up_k=1024, down_n=1, down_k=128)
# NOTE: Triton's CPU interpreter pays per program, so its tests run taller tiles (the masks
# and several blocks of rows are still exercised at the tests' shapes).
INTERPRETER_CONFIG = SmallBatchConfig(gate_up_n=16, down_n=8)


def _scale_args(scales: ExpertScales | None, fallback: torch.Tensor, block_k: int):
    """(scale tensor, mode, strides, group_n, group_k, block_k) for a launch."""
    if scales is None:
        return fallback, 0, (0, 0, 0), 1, 1, block_k
    strides = scales.scale.stride()
    if scales.block_size is None:
        return scales.scale, 1, (strides[0], strides[1], 0), 1, 1, block_k
    group_n, group_k = scales.block_size
    return scales.scale, 2, strides, group_n, group_k, min(block_k, group_k)


def fused_moe_small_batch(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scales: ExpertScales | None = None,
    w2_scales: ExpertScales | None = None,
    config: SmallBatchConfig | None = None,
) -> torch.Tensor:
    """:func:`kvflow.kernels.fused_moe`'s contract (inputs already checked there), one
    program per pair and block of output columns. Every pair reads its expert's weights,
    so it pays where pairs rarely share an expert (decode). ``config``: the tiles (None:
    :data:`DEFAULT_CONFIG`)."""
    if config is None:
        config = INTERPRETER_CONFIG if is_interpreted(_gate_up_kernel) else DEFAULT_CONFIG
    tokens, hidden_size = hidden.shape
    inter = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = tokens * top_k
    ids = topk_ids.reshape(-1)
    routed = topk_weights.reshape(-1)
    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty_like(hidden)

    block_k = min(config.gate_up_k, next_power_of_2(hidden_size))
    scale, mode, s_strides, group_n, group_k, block_k = _scale_args(w13_scales, act, block_k)
    block_n = config.gate_up_n * max(config.gate_up_k // block_k, 1)  # keep the tile's size
    _gate_up_kernel[(num_pairs, triton.cdiv(inter, block_n))](
        hidden, w13, scale, ids, act,
        inter, hidden_size, top_k,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        *s_strides, group_n, group_k,
        SCALES=mode, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=config.num_warps,
    )  # fmt: skip

    block_k = min(config.down_k, next_power_of_2(inter))
    scale, mode, s_strides, group_n, group_k, block_k = _scale_args(w2_scales, out, block_k)
    block_n = config.down_n * max(config.down_k // block_k, 1)
    _down_kernel[(tokens, triton.cdiv(hidden_size, block_n))](
        act, w2, scale, ids, routed, out,
        hidden_size, inter, top_k,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        *s_strides, group_n, group_k,
        SCALES=mode, TOP_K=next_power_of_2(top_k), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=config.num_warps,
    )  # fmt: skip
    return out
