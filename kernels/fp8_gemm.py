"""FP8 (``float8_e4m3fn``) activation quantization and GEMMs, each beside its torch
reference.

- :func:`per_token_group_quant_fp8`: one pass over ``x`` ``[M, K]`` that takes each
  ``group_size`` columns of a row, scales them by their absolute maximum / 448 and writes
  the FP8 values and the float32 scale (``group_size = K``: per-token scales).
- :func:`w8a8_block_fp8_matmul`: ``(xq * x_scale) @ (w * w_scale).T`` with ``x_scale`` per
  token and group of ``block_k`` columns and ``w_scale`` per ``block_n x block_k`` block of
  ``w`` ``[N, K]`` (DeepSeek-V3 / Qwen3 FP8), accumulated in float32.
- :func:`fp8_rowwise_mm`: per-token x per-output-channel scales through
  ``torch._scaled_mm`` (cuBLASLt, CUDA only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels._launch import is_interpreted

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "fp8_kernels_take",
    "fp8_rowwise_mm",
    "fp8_rowwise_mm_ref",
    "per_token_group_quant_fp8",
    "per_token_group_quant_fp8_ref",
    "w8a8_block_fp8_matmul",
    "w8a8_block_fp8_matmul_ref",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_EPS = 1e-10  # an all-zero group gets this absmax, not a zero scale


@triton.jit
def _group_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    group_size, stride_xm, stride_qm, groups_per_row,
    fp8_max, eps,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0) // groups_per_row
    group = tl.program_id(0) % groups_per_row
    offs = tl.arange(0, BLOCK)
    mask = offs < group_size
    col = group * group_size + offs
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + col, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x)), eps) / fp8_max
    q = tl.clamp(x / scale, -fp8_max, fp8_max)
    tl.store(q_ptr + row.to(tl.int64) * stride_qm + col, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * groups_per_row + group, scale)


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` (unit column stride, ``K % group_size == 0``) -> FP8 ``[M, K]`` and
    float32 scales ``[M, K // group_size]`` with ``x ~= q * scale`` per group."""
    rows, cols = x.shape
    if cols % group_size or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} does not split into groups of {group_size}")
    groups = cols // group_size
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scales
    block = triton.next_power_of_2(group_size)
    _group_quant_kernel[(rows * groups,)](
        x, q, scales, group_size, x.stride(0), q.stride(0), groups, FP8_MAX, _EPS,
        BLOCK=block, num_warps=min(8, max(1, block // 256)),
    )  # fmt: skip
    return q, scales


def per_token_group_quant_fp8_ref(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    grouped = x.float().view(rows, cols // group_size, group_size)
    scales = grouped.abs().amax(dim=-1).clamp(min=_EPS) / FP8_MAX
    q = (grouped / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows, cols), scales


def fp8_kernels_take(tensor: torch.Tensor) -> bool:
    """Whether these kernels run on ``tensor``'s device: CUDA, or CPU under Triton's
    interpreter (``torch._scaled_mm`` has a CPU implementation too)."""
    return tensor.is_cuda or (tensor.device.type == "cpu" and is_interpreted(_group_quant_kernel))


@triton.jit
def _block_fp8_matmul_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr,
    M, N, K, block_n, block_k,
    stride_am, stride_bn, stride_cm, stride_as_m, stride_bs_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    # NOTE: BLOCK_K == block_k, so each K step reads one activation scale per row and one
    # weight scale per column of the tile.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_rows
    pid_n = (pid % pids_per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + offs_m * stride_as_m
    bs_ptrs = bs_ptr + (offs_n // block_n) * stride_bs_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        a_s = tl.load(as_ptrs + k, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + k, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def w8a8_block_fp8_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block_size: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``xq`` FP8 ``[M, K]`` with ``x_scale`` ``[M, ceil(K / block_k)]``, ``w`` FP8 ``[N, K]``
    with ``w_scale`` ``[ceil(N / block_n), ceil(K / block_k)]`` -> ``[M, N]`` in
    ``out_dtype``. Every tensor has unit stride along its last dimension; ``block_k`` is a
    power of two of at least 16 (the kernel's K step)."""
    block_n, block_k = block_size
    rows, k = xq.shape
    n = w.shape[0]
    if w.shape[1] != k or x_scale.shape != (rows, -(-k // block_k)):
        raise ValueError(
            f"shapes x {tuple(xq.shape)}, x_scale {tuple(x_scale.shape)}, w {tuple(w.shape)}"
        )
    if x_scale.stride(1) != 1 or w_scale.stride(1) != 1:
        raise ValueError("scales need a unit stride along K")
    if w_scale.shape != (-(-n // block_n), -(-k // block_k)):
        raise ValueError(f"w_scale {tuple(w_scale.shape)} for w {tuple(w.shape)} in {block_size}")
    out = torch.empty((rows, n), dtype=out_dtype, device=xq.device)
    if rows == 0:
        return out
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    tile_n = min(block_n, 128)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, tile_n),)
    _block_fp8_matmul_kernel[grid](
        xq, w, out, x_scale, w_scale,
        rows, n, k, block_n, block_k,
        xq.stride(0), w.stride(0), out.stride(0), x_scale.stride(0), w_scale.stride(0),
        BLOCK_M=block_m, BLOCK_N=tile_n, BLOCK_K=block_k, GROUP_M=8,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


def _expand_blocks(
    scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]
) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def w8a8_block_fp8_matmul_ref(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block_size: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    rows, k = xq.shape
    x = xq.float() * _expand_blocks(x_scale, rows, k, (1, block_size[1]))
    weight = w.float() * _expand_blocks(w_scale, w.shape[0], k, block_size)
    return (x @ weight.T).to(out_dtype)


def fp8_rowwise_mm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``xq`` FP8 ``[M, K]`` with ``x_scale`` float32 ``[M, 1]``, ``w`` FP8 ``[N, K]`` (rows
    contiguous) with ``w_scale`` float32 ``[1, N]`` -> ``[M, N]`` in ``out_dtype``, through
    ``torch._scaled_mm`` (row-wise scales; cuBLASLt writes bfloat16, cast after). K and N
    are multiples of 16."""
    out = torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


def fp8_rowwise_mm_ref(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return ((xq.float() * x_scale) @ (w.float() * w_scale.view(-1, 1)).T).to(out_dtype)
