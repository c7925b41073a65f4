"""Segmented LoRA matmuls (S-LoRA/Punica's SGMV, SGLang's ``lora/triton_ops``).

A batch's token rows are visited in segments: positions ``seg_indptr[g] : seg_indptr[g +
1]`` (CSR offsets) use adapter slot ``seg_slots[g]`` of the stacked weights, or none when
the slot is negative (the base model's rows, a graph's padding). Position ``p`` is token row
``row_order[p]`` (None: row ``p``): the decode graphs sort their rows by slot, so each
adapter is one segment whatever the batch's order; a prefill's requests on one slot that
sit next to each other form one segment with no permutation. For one projection with ``A``
``[slots, R, K]`` and ``B`` ``[slots, N, R]`` (the scaling folded into ``B``), the LoRA
delta is ``lora_expand(lora_shrink(x, A), B, out)``:

- :func:`lora_shrink`: ``h[p] = x[row p] @ A[slot].T`` -> ``[T, R]`` by position (zeros
  on the base model's positions);
- :func:`lora_expand`: ``out[row p] += h[p] @ B[slot].T``, in place.

A small batch (a decode step) may shrink densely instead: :func:`lora_shrink_dense`
multiplies every row by every slot's ``A`` in one GEMM (``[T, slots * R]`` by token row,
cuBLAS on CUDA), and the expand reads each row's slot's block of it (``h_by_slot``). One
library GEMM replaces the segmented shrink and the sum of its split-K partials (two
latency-bound kernels a projection); it reads every slot's ``A`` at the full width, a few
MB a layer.

Ranks: ``R`` is ``shards * width`` (one block of ``width`` = ``--max-lora-rank`` per shard
of a merged QKV or gate-up layer), and an adapter of rank ``r = slot_ranks[slot]`` fills
the first ``r`` rows of each block of ``A`` and columns of ``B``; ``B`` is block-diagonal
(shard ``s``'s output rows, ``shard_rows[s]`` of them, meet only block ``s``)::

    A[slot]  rows  | s0: r of width | s1: r of width | ...      (zeros past r)
    B[slot]  rows of s0 x block 0, rows of s1 x block 1, ...     (zeros elsewhere)

The kernels read nothing past a slot's rank and no off-diagonal block: the slots hold zeros
there, so this only skips work (a rank-16 adapter among rank-64 ones costs rank 16).

The shrink's output is narrow and its reduction wide (``K``: the hidden or intermediate
size), so a decode batch gives it one or two column blocks per segment, and one program per
block would walk all of ``K`` alone (12-49 us a projection on an H200, against 2.5-5 us
split). It is split over ``K`` (split-K, as Punica's and SGLang's shrink kernels): ``S``
programs per block write float32 partial products ``[S, T, R]``, summed in a fixed order by
a small kernel (deterministic, no atomics). Once per projection: summing them inside the
expand re-read them once per output column block.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from kvflow.kernels._launch import (
    dot_precision,
    is_interpreted,
    multiprocessor_count,
    next_power_of_2,
)
from kvflow.kernels.lora_ref import lora_expand_ref, lora_shrink_ref

__all__ = ["lora_expand", "lora_expand_ref", "lora_shrink", "lora_shrink_ref"]

_MIN_K_PER_SPLIT = 256  # a split's share of K: below this the partials cost more than it saves
_MAX_SPLITS = 16


@triton.jit
def _segment_rows(seg_indptr_ptr, row_order_ptr, seg, pid_m, BLOCK_M: tl.constexpr,
                  HAS_ROW_ORDER: tl.constexpr):  # fmt: skip
    """Row block ``pid_m`` of segment ``seg``: its positions, their mask, their token rows
    (int64) and whether the block holds any position."""
    start = tl.load(seg_indptr_ptr + seg)
    end = tl.load(seg_indptr_ptr + seg + 1)
    offs_m = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    if HAS_ROW_ORDER:
        rows = tl.load(row_order_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        rows = offs_m.to(tl.int64)
    return offs_m, mask_m, rows, start + pid_m * BLOCK_M < end


@triton.jit
def _slot_rank(slot_ranks_ptr, slot, WIDTH, HAS_RANKS: tl.constexpr):
    """The rows of a shard's block that ``slot``'s adapter fills (``WIDTH`` without ranks)."""
    if HAS_RANKS:
        return tl.minimum(tl.load(slot_ranks_ptr + tl.maximum(slot, 0)), WIDTH)
    return WIDTH


# NOTE: the token count enters only through strides and sizes that vary every step: not
# specialized on, so a new batch size compiles nothing
@triton.jit(do_not_specialize=["stride_os"])
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, seg_indptr_ptr, seg_slots_ptr, row_order_ptr, slot_ranks_ptr,
    K, WIDTH, K_PER_SPLIT, stride_xm, stride_as, stride_an, stride_os, stride_om,
    NUM_SHARDS: tl.constexpr, HAS_ROW_ORDER: tl.constexpr, HAS_RANKS: tl.constexpr,
    UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``out[split, positions of g, block] = x[rows, k of split] @ a[slot_g, block, k of
    split].T`` for one (row block, shard, column block of the shard) of segment ``g =
    program_id(1)`` and K split ``split = program_id(2)`` (``K_PER_SPLIT`` columns each, a
    multiple of ``BLOCK_K``). Columns past the slot's rank, and every column of a segment
    without a slot: zeros written, ``a`` not read."""
    seg = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(seg_slots_ptr + seg)
    blocks_per_shard = tl.cdiv(WIDTH, BLOCK_N)
    pid_m = tl.program_id(0) // (NUM_SHARDS * blocks_per_shard)
    shard = tl.program_id(0) // blocks_per_shard % NUM_SHARDS
    first_col = tl.program_id(0) % blocks_per_shard * BLOCK_N  # within the shard's block
    offs_m, mask_m, rows, any_row = _segment_rows(
        seg_indptr_ptr, row_order_ptr, seg, pid_m, BLOCK_M, HAS_ROW_ORDER
    )
    if any_row:
        offs_c = first_col + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        rank = _slot_rank(slot_ranks_ptr, slot, WIDTH, HAS_RANKS)
        if (slot >= 0) & (first_col < rank):
            offs_k = split * K_PER_SPLIT + tl.arange(0, BLOCK_K)
            mask_c = offs_c < rank
            x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
            a_ptrs = (
                a_ptr + slot.to(tl.int64) * stride_as
                + (shard * WIDTH + offs_c)[None, :].to(tl.int64) * stride_an + offs_k[:, None]
            )  # fmt: skip
            for step_k in range(0, K_PER_SPLIT, BLOCK_K):  # one trip count in every split
                mask_k = offs_k + step_k < K
                x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                a = tl.load(a_ptrs, mask=mask_k[:, None] & mask_c[None, :], other=0.0)
                if UPCAST_DOT:  # NOTE: Triton's CPU interpreter has no bf16 dot
                    x = x.to(tl.float32)
                    a = a.to(tl.float32)
                acc += tl.dot(x, a.to(x.dtype), input_precision=PRECISION)
                x_ptrs += BLOCK_K
                a_ptrs += BLOCK_K
        out_ptrs = (
            out_ptr + split.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om
            + (shard * WIDTH + offs_c)[None, :]
        )  # fmt: skip
        mask = mask_m[:, None] & (offs_c < WIDTH)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, out_ptr, base_ptr, seg_indptr_ptr, seg_slots_ptr, row_order_ptr,
    slot_ranks_ptr, WIDTH, stride_hm, stride_hs, stride_bs, stride_bn, stride_bk, stride_om,
    stride_basem,
    SHARD_BOUNDS: tl.constexpr, NUM_SHARDS: tl.constexpr, HAS_ROW_ORDER: tl.constexpr,
    HAS_RANKS: tl.constexpr, H_BY_SLOT: tl.constexpr, HAS_BASE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``out[rows of g, block] += h[positions of g, shard's first rank columns] @ b[slot_g,
    block, the same columns].T`` for one (row block, output column block) of segment ``g =
    program_id(1)``; an output block across a shard boundary takes each shard's part with
    its own columns (``SHARD_BOUNDS``: the shards' first output rows, then ``N``). Rows of a
    segment without a slot are left alone. ``H_BY_SLOT``: ``h``'s row is the token row and
    the slot's block starts at column ``slot * stride_hs`` (the dense shrink's layout).
    ``HAS_BASE``: ``out[rows, block] = base[rows, block] + delta`` instead, for the rows of
    every segment (a segment without a slot: a copy)."""
    seg = tl.program_id(1)
    slot = tl.load(seg_slots_ptr + seg)
    N: tl.constexpr = SHARD_BOUNDS[NUM_SHARDS]
    num_n_blocks: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = tl.program_id(0) // num_n_blocks
    first_n = tl.program_id(0) % num_n_blocks * BLOCK_N
    offs_m, mask_m, rows, any_row = _segment_rows(
        seg_indptr_ptr, row_order_ptr, seg, pid_m, BLOCK_M, HAS_ROW_ORDER
    )
    if ((slot >= 0) | HAS_BASE) & any_row:
        rank = tl.where(slot >= 0, _slot_rank(slot_ranks_ptr, slot, WIDTH, HAS_RANKS), 0)
        offs_n = first_n + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if H_BY_SLOT:
            h_rows = h_ptr + rows[:, None] * stride_hm + slot.to(tl.int64) * stride_hs
        else:
            h_rows = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm
        for shard in tl.static_range(NUM_SHARDS):
            lo = SHARD_BOUNDS[shard]
            hi = SHARD_BOUNDS[shard + 1]
            if (first_n < hi) & (first_n + BLOCK_N > lo):
                offs_k = tl.arange(0, BLOCK_K)
                mask_n = (offs_n >= lo) & (offs_n < hi)
                h_ptrs = h_rows + shard * WIDTH + offs_k[None, :]
                b_ptrs = (
                    b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :].to(tl.int64) * stride_bn
                    + (shard * WIDTH + offs_k[:, None]).to(tl.int64) * stride_bk
                )  # fmt: skip
                for step_k in range(0, rank, BLOCK_K):  # NOTE: stops at the adapter's rank
                    mask_k = offs_k + step_k < rank
                    h = tl.load(h_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                    if UPCAST_DOT:
                        h = h.to(tl.float32)
                        b = b.to(tl.float32)
                    acc += tl.dot(h, b.to(h.dtype), input_precision=PRECISION)
                    h_ptrs += BLOCK_K
                    b_ptrs += BLOCK_K * stride_bk
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        if HAS_BASE:
            base_ptrs = base_ptr + rows[:, None] * stride_basem + offs_n[None, :]
            acc += tl.load(base_ptrs, mask=mask, other=0.0).to(tl.float32)
        else:
            acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# NOTE: the split count varies with the batch's rows: a run-time bound, so a new count
# compiles nothing
@triton.jit(do_not_specialize=["numel", "splits"])
def _sum_splits_kernel(partials_ptr, out_ptr, numel, splits, BLOCK: tl.constexpr):
    """``out[i] = sum over s of partials[s * numel + i]`` (in order, float32)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(splits):
        acc += tl.load(partials_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(
    x: torch.Tensor,
    weights: torch.Tensor,
    *layout: torch.Tensor | None,
    any_strides: bool = False,
) -> None:
    """Shapes, strides (``any_strides``: the weights' are free) and the layout's dtypes."""
    if x.dim() != 2 or weights.dim() != 3 or x.shape[1] != weights.shape[2]:
        raise ValueError(f"x [T, K] and weights [slots, N, K], got {x.shape}, {weights.shape}")
    if x.stride(1) != 1 or (weights.stride(2) != 1 and not any_strides):
        raise ValueError("x and weights need a contiguous last dimension")
    if any(t is not None and t.dtype != torch.int32 for t in layout):
        raise ValueError("seg_indptr, seg_slots, row_order and slot_ranks are int32")


def _block(size: int, most: int) -> int:
    """A power of two covering ``size`` up to ``most``, and at least 16 (``tl.dot``'s
    smallest)."""
    return min(most, max(16, next_power_of_2(size)))


def _num_splits(x: torch.Tensor, programs: int, k: int, block_k: int) -> int:
    """K splits for a grid of ``programs`` that hold rows: a power of two (few distinct
    kernels to compile) filling the device about twice over, each split keeping >=
    ``_MIN_K_PER_SPLIT`` of K."""
    if not x.is_cuda:
        return 1
    want = triton.cdiv(2 * multiprocessor_count(x.device.index or 0), programs)
    most = min(_MAX_SPLITS, k // max(block_k, _MIN_K_PER_SPLIT))
    return max(1, min(next_power_of_2(want), most))


def _flags(
    row_order: torch.Tensor | None, slot_ranks: torch.Tensor | None, seg_slots: torch.Tensor
) -> dict[str, object]:
    """The optional pointers (``seg_slots`` stands in for an absent one: never read) and
    their flags."""
    return dict(
        row_order_ptr=seg_slots if row_order is None else row_order,
        slot_ranks_ptr=seg_slots if slot_ranks is None else slot_ranks,
        HAS_ROW_ORDER=row_order is not None,
        HAS_RANKS=slot_ranks is not None,
    )


def lora_shrink(
    x: torch.Tensor,
    a_weights: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    splits: int | None = None,
    *,
    row_order: torch.Tensor | None = None,
    slot_ranks: torch.Tensor | None = None,
    num_shards: int = 1,
) -> torch.Tensor:
    """``x`` ``[T, K]``, ``a_weights`` ``[slots, R, K]`` -> ``h`` ``[T, R]`` in ``x``'s
    dtype, by position (zeros on positions of segments without a slot and past each slot's
    rank in each of the ``num_shards`` blocks; positions outside every segment undefined).
    ``max_seg_len``: the longest segment's positions (known on the host, so the grid needs
    no device read). ``row_order`` ``[>= positions]``: each position's row of ``x``;
    ``slot_ranks`` ``[slots]``: each slot's adapter rank (None: every block full).
    ``splits``: how many parts of K run in parallel (forced in tests; None: chosen for the
    device's size)."""
    _check(x, a_weights, seg_indptr, seg_slots, row_order, slot_ranks)
    stacked, k = a_weights.shape[1], a_weights.shape[2]
    if stacked % num_shards:
        raise ValueError(f"{stacked} rows of A do not split into {num_shards} shards")
    h = torch.empty((x.shape[0], stacked), dtype=x.dtype, device=x.device)
    num_segments = seg_slots.shape[0]
    if num_segments == 0 or max_seg_len == 0:
        return h.zero_()
    width = stacked // num_shards
    block_m, block_n, block_k = _block(max_seg_len, 64), _block(width, 128), _block(k, 64)
    row_blocks = triton.cdiv(max_seg_len, block_m)
    col_blocks = num_shards * triton.cdiv(width, block_n)
    if splits is None:
        # NOTE: the grouped decode layout's segments are mostly shorter than max_seg_len
        # (one per slot, each up to the whole batch): count the row blocks that can hold rows
        busy = min(row_blocks * num_segments, triton.cdiv(x.shape[0], block_m) + num_segments - 1)
        splits = _num_splits(x, busy * col_blocks, k, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, max(1, splits)), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)  # (rounding to whole blocks may leave fewer)
    # split-K: float32 partial products [splits, T, R], summed into h below
    target = h if splits == 1 else x.new_empty((splits, *h.shape), dtype=torch.float32)
    interpreted = is_interpreted(_shrink_kernel)
    _shrink_kernel[(row_blocks * col_blocks, num_segments, splits)](
        x, a_weights, target, seg_indptr, seg_slots,
        K=k, WIDTH=width, K_PER_SPLIT=k_per_split, stride_xm=x.stride(0),
        stride_as=a_weights.stride(0), stride_an=a_weights.stride(1),
        stride_os=target.stride(0) if splits > 1 else 0, stride_om=target.stride(-2),
        NUM_SHARDS=num_shards, UPCAST_DOT=interpreted,
        PRECISION="ieee" if interpreted else dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        **_flags(row_order, slot_ranks, seg_slots),
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(h.numel(), block),)](
            target, h, h.numel(), splits, BLOCK=block
        )
    return h


def lora_expand(
    h: torch.Tensor,
    b_weights: torch.Tensor,
    out: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    *,
    row_order: torch.Tensor | None = None,
    slot_ranks: torch.Tensor | None = None,
    shard_rows: tuple[int, ...] | None = None,
    h_by_slot: bool = False,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[row p] += h[p] @ b_weights[slot].T`` in place for every position ``p`` of a
    segment with a slot (``h`` ``[T, R]`` by position, ``b_weights`` ``[slots, N, R]``,
    ``out`` ``[T, N]`` with rows of stride ``out.stride(0)`` and contiguous columns;
    ``b_weights`` of any strides, e.g. a transposed view of ``[slots, R, N]``); returns
    ``out``. ``shard_rows``: the output rows of each shard (None: one shard), shard
    ``s`` reading only block ``s`` of ``R``, up to the slot's rank (``slot_ranks``);
    ``row_order`` as :func:`lora_shrink`'s, its rows distinct. ``h_by_slot``: ``h`` is
    :func:`lora_shrink_dense`'s ``[T, slots * R]`` by token row, read at the row's slot.
    ``base`` (``[T, N]``, contiguous columns, any row stride): ``out[row p] = base[row p] +
    delta`` for every position of every segment instead, a segment without a slot copying
    its rows; ``out`` is then written, never read, and the segments must cover its rows."""
    if out.stride(1) != 1 or out.shape != (h.shape[0], b_weights.shape[1]):
        raise ValueError(f"out must be [T, N] with contiguous columns, got {out.shape}")
    if base is not None and (base.shape != out.shape or base.stride(1) != 1):
        raise ValueError(f"base must be [T, N] with contiguous columns, got {base.shape}")
    n, stacked = b_weights.shape[1], b_weights.shape[2]
    if h_by_slot and h.shape[1] != b_weights.shape[0] * stacked:
        raise ValueError(f"h by slot is [T, slots * R], got {tuple(h.shape)}")
    per_slot = h[:, :stacked] if h_by_slot else h  # (by slot: slot 0's block stands for all)
    _check(per_slot, b_weights, seg_indptr, seg_slots, row_order, slot_ranks, any_strides=True)
    shard_rows = shard_rows or (n,)
    if sum(shard_rows) != n or stacked % len(shard_rows):
        raise ValueError(f"shards of {shard_rows} rows do not fit B {tuple(b_weights.shape)}")
    if seg_slots.shape[0] == 0 or max_seg_len == 0:
        return out
    width = stacked // len(shard_rows)
    block_m, block_n, block_k = _block(max_seg_len, 64), _block(n, 128), _block(width, 64)
    grid = (triton.cdiv(max_seg_len, block_m) * triton.cdiv(n, block_n), seg_slots.shape[0])
    interpreted = is_interpreted(_expand_kernel)
    _expand_kernel[grid](
        h, b_weights, out, out if base is None else base, seg_indptr, seg_slots,
        WIDTH=width, stride_hm=h.stride(0), stride_hs=stacked if h_by_slot else 0,
        stride_bs=b_weights.stride(0), stride_bn=b_weights.stride(1),
        stride_bk=b_weights.stride(2), stride_om=out.stride(0),
        stride_basem=out.stride(0) if base is None else base.stride(0),
        SHARD_BOUNDS=(0, *itertools.accumulate(shard_rows)), NUM_SHARDS=len(shard_rows),
        H_BY_SLOT=h_by_slot, HAS_BASE=base is not None, UPCAST_DOT=interpreted,
        PRECISION="ieee" if interpreted else dot_precision(h.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        **_flags(row_order, slot_ranks, seg_slots),
    )  # fmt: skip
    return out
