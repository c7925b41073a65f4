"""Matrix-vector product for one-token decode: ``out = x @ weight.T`` with ``x`` [1, K].

At batch 1 every projection of a decode step is a pass over its weight matrix; this kernel
gives each program a few whole rows of ``weight`` ([N, K], rows contiguous, as
``nn.Linear`` stores it) and streams them once, reducing in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gemv", "gemv_ref"]


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr,
    N, K, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for start_k in range(0, K, BLOCK_K):
        mask_k = start_k + offs_k < K
        x = tl.load(x_ptr + start_k + offs_k, mask=mask_k, other=0.0)
        w = tl.load(
            w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first"
        )
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


# (BLOCK_N, BLOCK_K, num_warps, num_stages). NOTE: swept on H100 over Llama-3.1-8B's
# projections (benchmarks/results/gpu.md): 2 rows x 1024 columns per step was best or
# within 2% for all five shapes, 1.07-1.25x faster than cuBLAS at M=1.
DEFAULT_CONFIG = (2, 1024, 4, 3)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] = DEFAULT_CONFIG,
) -> torch.Tensor:
    """``x`` [1, K] (contiguous) times ``weight.T`` (``weight`` [N, K], rows contiguous)
    -> ``out`` [1, N] in ``x``'s dtype (new unless given)."""
    rows, k = x.shape
    n = weight.shape[0]
    if rows != 1 or weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv takes x [1, K] and weight [N, K], got {x.shape}, {weight.shape}")
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, n, k, weight.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``x @ weight.T`` in fp32, rounded to ``x``'s dtype."""
    return (x.float() @ weight.float().t()).to(x.dtype)
