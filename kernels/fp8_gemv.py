"""FP8-weight matrix-vector product for one-token decode: ``out = x @ (w * scale).T`` with
``x`` [1, K] in float and ``w`` FP8 [N, K].

At batch 1 a projection is a pass over its weight, so the FP8 weight halves the bytes
read; the activation stays in its float dtype (no quantization, unlike the batched
GEMMs: nothing to gain at one row). Scales are per output row (``row_scale`` [N]) or per
``block_n x block_k`` block (``block_scale`` [ceil(N / block_n), ceil(K / block_k)]).
As :func:`kvflow.kernels.gemv`: each program streams a few whole rows, reducing in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fp8_gemv", "fp8_gemv_ref"]


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,
    N, K, stride_wn, stride_sn, block_n, block_k,
    BLOCKED: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``GROUP_K`` > 0 (block scales whose blocks hold the tile: ``block_k`` divides
    ``BLOCK_K``, the tile's rows are in one block row): each 128-column group is summed
    first and scaled once, one scale per group and tile instead of one per element."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    s_rows = s_ptr + (offs_n // block_n)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if GROUP_K > 0:
        groups = tl.zeros([BLOCK_N, BLOCK_K // GROUP_K], tl.float32)
        offs_g = tl.arange(0, BLOCK_K // GROUP_K)
        s_row = s_ptr + ((pid * BLOCK_N) // block_n) * stride_sn
        num_groups = tl.cdiv(K, GROUP_K)
    for start_k in range(0, K, BLOCK_K):
        mask_k = start_k + offs_k < K
        mask = mask_n[:, None] & mask_k[None, :]
        x = tl.load(x_ptr + start_k + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        product = w * x[None, :]
        if GROUP_K > 0:
            part = tl.sum(tl.reshape(product, (BLOCK_N, BLOCK_K // GROUP_K, GROUP_K)), axis=2)
            g = start_k // GROUP_K + offs_g
            groups += part * tl.load(s_row + g, mask=g < num_groups, other=0.0)[None, :]
        elif BLOCKED:
            # the scale tensor is small and read once per block column: cached loads
            scale = tl.load(s_rows + ((start_k + offs_k) // block_k)[None, :], mask=mask, other=0.0)
            acc += product * scale
        else:
            acc += product
        w_ptrs += BLOCK_K
    if GROUP_K > 0:
        out = tl.sum(groups, axis=1)
    else:
        out = tl.sum(acc, axis=1)
    if not BLOCKED:
        out = out * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


# (BLOCK_N, BLOCK_K, num_warps, num_stages), swept on an H200 (benchmarks/bench_fp8_gemv.py,
# Llama-3.1-8B's projections, 11 configurations): 8 rows x 512 columns was fastest where K
# is the hidden size (qkv 6.9 us, o 6.3, gate_up 34.4, per-row scales: 56-75% of HBM
# bandwidth, against 8.6 / 7.1 / 41.7 for the bf16 GEMV's 2 x 1024), 2 x 2048 for
# down_proj's K of 14,336 (21.9 us against 23.0).
DEFAULT_CONFIG = (8, 512, 4, 3)
WIDE_K_CONFIG = (2, 2048, 4, 3)
_WIDE_K = 8192


def fp8_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    row_scale: torch.Tensor | None = None,
    block_scale: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x`` [1, K] (contiguous) times the FP8 ``w`` [N, K] (rows contiguous) scaled by
    ``row_scale`` (float32, N values) or ``block_scale`` (float32 [ceil(N / block_n),
    ceil(K / block_k)], unit stride along K, with ``block_size`` (block_n, block_k)) ->
    [1, N] in ``x``'s dtype."""
    rows, k = x.shape
    n = w.shape[0]
    if rows != 1 or w.shape[1] != k or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"fp8_gemv takes x [1, K] and w [N, K], got {x.shape}, {w.shape}")
    if (row_scale is None) == (block_scale is None) or (block_scale is None) != (
        block_size is None
    ):
        raise ValueError("give row_scale, or block_scale and block_size")
    blocked = block_scale is not None
    scale = block_scale if block_scale is not None else row_scale
    assert scale is not None
    if blocked and scale.stride(1) != 1:
        raise ValueError("block_scale needs a unit stride along K")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if config is None:
        config = WIDE_K_CONFIG if k > _WIDE_K else DEFAULT_CONFIG
    block_n, block_k, num_warps, num_stages = config
    scale_n, scale_k = block_size or (1, 1)
    grouped = blocked and block_k % scale_k == 0 and scale_n % block_n == 0
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, scale, out,
        n, k, w.stride(0), scale.stride(0) if blocked else 0, scale_n, scale_k,
        BLOCKED=blocked, GROUP_K=scale_k if grouped else 0, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def fp8_gemv_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    row_scale: torch.Tensor | None = None,
    block_scale: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    n, k = w.shape
    if block_scale is not None:
        assert block_size is not None
        full = block_scale.float().repeat_interleave(block_size[0], 0)[:n]
        weight = w.float() * full.repeat_interleave(block_size[1], 1)[:, :k]
    else:
        assert row_scale is not None
        weight = w.float() * row_scale.float().reshape(-1, 1)
    return (x.float() @ weight.T).to(x.dtype)
