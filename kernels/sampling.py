"""Fused top-k / top-p sampling from probabilities, one program per row, no sort.

Probabilities are non-negative, so their fp32 bit patterns order like their values. Each
threshold is found by a 31-step binary search over bit patterns, every step one pass over
the row (from L2 after the first):

```
T_k = largest T with  count(bits >= T)           >= top_k                 (k-th largest)
T_p = largest T >= T_k with  sum(p | bits >= T)  >= top_p * sum(p | bits >= T_k)
keep p >= value(T_p); draw target = u * kept mass; pick the first index whose running
kept mass exceeds it
```

Ties at a threshold are kept, which matches a sort-based filter that keeps the shortest
prefix of the sorted row reaching the mass. The caller passes the uniform draws, so the
kernel has no RNG state and replays inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels._launch import is_interpreted

__all__ = ["kept_mask_ref", "top_k_top_p_sampling_from_probs", "top_k_top_p_sampling_ref"]

_INF_BITS = tl.constexpr(0x7F800000)  # +inf as int32 bits: above every probability


@triton.jit
def _count_and_mass(row_ptr, vocab, threshold_bits, floor_bits, BLOCK: tl.constexpr):
    """Count and mass of entries with bits >= threshold_bits (and >= floor_bits)."""
    count = tl.zeros([], tl.int32)
    mass = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        probs = tl.load(row_ptr + offs, mask=offs < vocab, other=0.0)
        bits = probs.to(tl.int32, bitcast=True)
        keep = (bits >= threshold_bits) & (bits >= floor_bits) & (offs < vocab)
        count += tl.sum(keep.to(tl.int32), 0)
        mass += tl.sum(tl.where(keep, probs, 0.0), 0)
    return count, mass


@triton.jit
def _sampling_kernel(
    probs_ptr, top_k_ptr, top_p_ptr, uniform_ptr, out_ptr, stride_row, vocab,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    row_ptr = probs_ptr + row.to(tl.int64) * stride_row
    top_k = tl.load(top_k_ptr + row)
    top_k = tl.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    top_p = tl.load(top_p_ptr + row)

    # Top-k: invariant count(bits >= lo) >= top_k > count(bits >= hi).
    lo = tl.zeros([], tl.int32)
    if top_k < vocab:
        hi = tl.full([], _INF_BITS + 1, tl.int32)
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            count, _mass = _count_and_mass(row_ptr, vocab, mid, 0, BLOCK)
            lo = tl.where(count >= top_k, mid, lo)
            hi = tl.where(count >= top_k, hi, mid)
    floor_bits = lo

    # Top-p over the top-k survivors: invariant mass(bits >= lo) >= target > mass(>= hi).
    _count, kept_mass = _count_and_mass(row_ptr, vocab, floor_bits, floor_bits, BLOCK)
    if top_p < 1.0:
        target_mass = top_p * kept_mass
        hi = tl.full([], _INF_BITS + 1, tl.int32)
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            _count, mass = _count_and_mass(row_ptr, vocab, mid, floor_bits, BLOCK)
            lo = tl.where(mass >= target_mass, mid, lo)
            hi = tl.where(mass >= target_mass, hi, mid)
        _count, kept_mass = _count_and_mass(row_ptr, vocab, lo, lo, BLOCK)

    # Inverse CDF over the kept entries, in vocabulary order.
    target = tl.load(uniform_ptr + row) * kept_mass
    running = tl.zeros([], tl.float32)
    chosen = tl.full([], 2147483647, tl.int32)
    last_kept = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        probs = tl.load(row_ptr + offs, mask=offs < vocab, other=0.0)
        keep = (probs.to(tl.int32, bitcast=True) >= lo) & (offs < vocab)
        kept = tl.where(keep, probs, 0.0)
        cumulative = tl.cumsum(kept, 0) + running
        hit = keep & (cumulative > target)
        chosen = tl.minimum(chosen, tl.min(tl.where(hit, offs, 2147483647), 0))
        last_kept = tl.maximum(last_kept, tl.max(tl.where(keep, offs, 0), 0))
        running += tl.sum(kept, 0)
    # NOTE: rounding can leave target >= the running total; the last kept entry then wins.
    tl.store(out_ptr + row, tl.where(chosen < vocab, chosen, last_kept).to(tl.int64))


def top_k_top_p_sampling_from_probs(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """Sample one token id per row of ``probs`` [batch, vocab] (fp32, non-negative, rows
    need not be normalised) after top-k then top-p filtering.

    ``top_k`` [batch] int32 (``<= 0`` or ``>= vocab``: no top-k), ``top_p`` [batch] fp32
    in (0, 1] (``1``: no top-p), ``uniform`` [batch] fp32 draws in [0, 1). Returns int64
    [batch]. Deterministic given ``uniform``; no host sync, CUDA-graph safe.
    """
    batch, vocab = probs.shape
    if probs.dtype != torch.float32 or probs.stride(1) != 1:
        raise ValueError("probs must be float32 with contiguous rows")
    out = torch.empty(batch, dtype=torch.int64, device=probs.device)
    if batch:
        block = 512 if is_interpreted(_sampling_kernel) else 4096
        _sampling_kernel[(batch,)](
            probs, top_k, top_p, uniform, out, probs.stride(0), vocab, BLOCK=block, num_warps=8
        )
    return out


def kept_mask_ref(row_probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Boolean [vocab] mask of the entries of one row that survive top-k then top-p (ties
    at either threshold kept); sort-based."""
    vocab = row_probs.numel()
    ordered = row_probs.sort(descending=True).values
    threshold = ordered[(vocab if top_k <= 0 or top_k > vocab else top_k) - 1]
    if top_p < 1.0:
        kept_sorted = ordered[ordered >= threshold]
        cumulative = kept_sorted.cumsum(0)
        cut = int(torch.searchsorted(cumulative, top_p * cumulative[-1]))
        threshold = kept_sorted[min(cut, kept_sorted.numel() - 1)]
    return row_probs >= threshold


def top_k_top_p_sampling_ref(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """Pure-torch, sort-based :func:`top_k_top_p_sampling_from_probs` (same contract)."""
    batch, vocab = probs.shape
    out = torch.empty(batch, dtype=torch.int64, device=probs.device)
    for row in range(batch):
        keep = kept_mask_ref(probs[row], int(top_k[row]), float(top_p[row]))
        kept = torch.where(keep, probs[row], 0.0)
        cumulative = kept.cumsum(0)
        index = int(torch.searchsorted(cumulative, uniform[row] * cumulative[-1], right=True))
        out[row] = index if index < vocab else int(keep.nonzero().max())
    return out
