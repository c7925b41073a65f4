"""Gated activations over a merged ``[gate | up]`` row: Llama's SwiGLU ``silu(gate) * up``
and Gemma's GeGLU ``gelu_tanh(gate) * up``, one kernel each way."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["gelu_tanh_and_mul", "gelu_tanh_and_mul_ref", "silu_and_mul", "silu_and_mul_ref"]

_BLOCK = 1024


_GELU_TANH_C = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, intermediate, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate + cols, mask=mask, other=0.0)
    if GELU_TANH:
        # torch's tanh form, with tanh(z) = 2 * sigmoid(2z) - 1
        inner = _GELU_TANH_C * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 * tl.sigmoid(2.0 * inner))
    else:
        act = gate * tl.sigmoid(gate)
    # NOTE: the activation is rounded to the input dtype before the product, as
    # F.silu(gate) * up (F.gelu) does.
    out = act.to(x_ptr.dtype.element_ty).to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    tokens, width = x.shape
    intermediate = width // 2
    out = torch.empty((tokens, intermediate), dtype=x.dtype, device=x.device)
    if tokens and intermediate:
        grid = (tokens, triton.cdiv(intermediate, _BLOCK))
        _act_and_mul_kernel[grid](
            x, out, x.stride(0), out.stride(0), intermediate,
            GELU_TANH=gelu_tanh, BLOCK=_BLOCK, num_warps=4,
        )  # fmt: skip
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` [tokens, 2 * intermediate] (gate first, up second; rows contiguous) ->
    new tensor [tokens, intermediate] = ``silu(gate) * up``."""
    return _act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (transformers' ``gelu_pytorch_tanh``); the
    same contract as :func:`silu_and_mul`."""
    return _act_and_mul(x, gelu_tanh=True)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``silu(gate) * up``; same contract as :func:`silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``gelu_tanh(gate) * up``; same contract as :func:`gelu_tanh_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
