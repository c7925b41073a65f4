"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer.

Rounding follows Hugging Face Llama exactly: the residual sum is rounded to the input
dtype, normalisation runs in fp32, the normalised value is rounded back to the input dtype
and only then multiplied by the weight (``weight * x_normed.to(input_dtype)``).

``unit_offset``: Gemma's variant (transformers' ``Gemma2RMSNorm``): the stored weight is an
offset from 1, and the normalised value is scaled by ``1 + w`` in fp32 and rounded once, to
the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels._launch import next_power_of_2

__all__ = ["rmsnorm", "rmsnorm_ref"]


@triton.jit
def _rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden
    normed = x * tl.math.rsqrt(variance + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        out = normed * (1.0 + weight)
    else:
        out = weight * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` [tokens, hidden] with ``weight`` [hidden] (rows contiguous).

    Without ``residual``: returns the normalised tensor. With ``residual`` (same shape as
    ``x``): computes ``r = x + residual`` and returns ``(rmsnorm(r) * weight, r)`` as two
    new tensors; the inputs are not modified. The output dtype is the promotion of
    ``weight`` and ``x`` (as ``weight * x_normed.to(x.dtype)`` in HF); with
    ``unit_offset`` (Gemma), ``x``'s dtype.
    """
    tokens, hidden = x.shape
    dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty_like(x, dtype=dtype)
    residual_out = torch.empty_like(x) if residual is not None else out
    if tokens:
        block = next_power_of_2(hidden)
        _rmsnorm_kernel[(tokens,)](
            x, residual if residual is not None else x, weight, out, residual_out,
            x.stride(0), residual.stride(0) if residual is not None else 0,
            out.stride(0), residual_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )  # fmt: skip
    return (out, residual_out) if residual is not None else out


def rmsnorm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch RMSNorm, the Hugging Face Llama way (Gemma's with ``unit_offset``); same
    contract as :func:`rmsnorm`."""
    if residual is not None:
        x = x + residual
    input_dtype = x.dtype
    hidden = x.float()
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    if unit_offset:
        out = (hidden * (1.0 + weight.float())).to(input_dtype)
    else:
        out = weight * hidden.to(input_dtype)
    return (out, x) if residual is not None else out
