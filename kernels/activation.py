"""SiLU-and-multiply, the gated activation of Llama's MLP: ``silu(gate) * up``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["silu_and_mul", "silu_and_mul_ref"]

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, intermediate, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate + cols, mask=mask, other=0.0)
    # NOTE: silu is rounded to the input dtype before the product, as F.silu(gate) * up does.
    act = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` [tokens, 2 * intermediate] (gate first, up second; rows contiguous) ->
    new tensor [tokens, intermediate] = ``silu(gate) * up``."""
    tokens, width = x.shape
    intermediate = width // 2
    out = torch.empty((tokens, intermediate), dtype=x.dtype, device=x.device)
    if tokens and intermediate:
        grid = (tokens, triton.cdiv(intermediate, _BLOCK))
        _silu_and_mul_kernel[grid](
            x, out, x.stride(0), out.stride(0), intermediate, BLOCK=_BLOCK, num_warps=4
        )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``silu(gate) * up``; same contract as :func:`silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
