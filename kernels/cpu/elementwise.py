"""Row-wise ops of the Llama layer on CPU (``elementwise.c``), same contracts as the Triton
kernels in :mod:`kvflow.kernels` and their torch references (which these match: the tests
compare them), for float32 and bfloat16 CPU tensors with a contiguous last dimension."""

from __future__ import annotations

import ctypes

import torch

from kvflow.kernels.cpu.build import function
from kvflow.kernels.rotary_ref import heads_view

__all__ = ["MAX_HIDDEN", "rmsnorm", "rotary_embedding", "silu_and_mul", "store_kv", "supports"]

MAX_HIDDEN = 8192  # the C kernel keeps one float32 row on the stack
DTYPES = (torch.float32, torch.bfloat16)

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_RMSNORM = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _INT, _F32, _INT]
_ROTARY = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _INT, _INT, _INT, _INT]
_SILU = [_PTR, _I64, _PTR, _I64, _I64, _INT, _INT]
_STORE_KV = [
    _PTR,
    _PTR,
    _I64,
    _I64,
    _PTR,
    _I64,
    _I64,
    _PTR,
    _I64,
    _I64,
    _PTR,
    _I64,
    _INT,
    _INT,
    _INT,
]


def supports(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can go to the C kernels: CPU, one float32/bfloat16 dtype, the
    last dimension contiguous."""
    dtype = tensors[0].dtype
    return dtype in DTYPES and all(
        t.device.type == "cpu" and t.dtype == dtype and t.stride(-1) == 1 for t in tensors
    )


def _check(*tensors: torch.Tensor) -> int:
    if not supports(*tensors):
        raise ValueError("CPU float32/bfloat16 tensors of one dtype, last dim contiguous")
    return int(tensors[0].dtype == torch.bfloat16)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * norm(x)``, or ``(weight * norm(x + residual), x + residual)``; x ``[n,
    hidden]``. New tensors; the inputs are not modified."""
    n, hidden = x.shape
    if hidden > MAX_HIDDEN or weight.shape != (hidden,):
        raise ValueError(f"hidden size {hidden} (weight {tuple(weight.shape)}) not supported")
    is_bf16 = _check(x, weight, *(() if residual is None else (residual,)))
    out = torch.empty((n, hidden), dtype=x.dtype)
    summed = None if residual is None else torch.empty_like(out)
    function("kvflow_rmsnorm", _RMSNORM)(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        None if summed is None else summed.data_ptr(),
        hidden,
        weight.contiguous().data_ptr(),
        out.data_ptr(),
        hidden,
        n,
        hidden,
        eps,
        is_bf16,
    )
    return out if summed is None else (out, summed)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates ``q`` and ``k`` in place (NeoX layout) and returns them; shapes as
    :func:`kvflow.kernels.rotary_embedding` (``[tokens, heads * head_dim]`` or ``[tokens,
    heads, head_dim]``), ``cos_sin_cache`` float32 ``[positions, head_dim]``."""
    is_bf16 = _check(q, k)
    q_heads, k_heads = heads_view(q, head_dim), heads_view(k, head_dim)
    n = q_heads.shape[0]
    if k_heads.shape[0] != n:
        raise ValueError("q and k must cover the same tokens")
    if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        raise ValueError("cos_sin_cache must be contiguous float32")
    positions = positions.to(torch.int64).contiguous()
    function("kvflow_rotary", _ROTARY)(
        q_heads.data_ptr(),
        q_heads.stride(0),
        q_heads.stride(1),
        k_heads.data_ptr(),
        k_heads.stride(0),
        k_heads.stride(1),
        positions.data_ptr(),
        cos_sin_cache.data_ptr(),
        n,
        q_heads.shape[1],
        k_heads.shape[1],
        head_dim,
        is_bf16,
    )
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x`` ``[n, 2 * width]`` = ``[gate | up]``; a new tensor."""
    is_bf16 = _check(x)
    n, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((n, width), dtype=x.dtype)
    function("kvflow_silu_and_mul", _SILU)(
        x.data_ptr(), x.stride(0), out.data_ptr(), width, n, width, is_bf16
    )
    return out


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """:func:`kvflow.kernels.store_kv_cache` on CPU: ``k``, ``v`` ``[tokens, kv_heads,
    head_dim]`` into the buffers ``[slots, kv_heads, head_dim]`` at slots ``loc`` (distinct,
    in range: not checked here), all one dtype."""
    _check(k_buffer, v_buffer, k, v)
    n, heads, dim = k.shape
    if (
        v.shape != k.shape
        or k_buffer.shape[1:] != (heads, dim)
        or k_buffer.stride() != v_buffer.stride()
    ):
        raise ValueError("k/v rows and the buffers must agree in heads and head_dim")
    if loc.numel() != n:
        raise ValueError(f"loc needs {n} slots")
    loc = loc.to(torch.int64).contiguous()
    function("kvflow_store_kv", _STORE_KV)(
        k_buffer.data_ptr(),
        v_buffer.data_ptr(),
        k_buffer.stride(0),
        k_buffer.stride(1),
        k.data_ptr(),
        k.stride(0),
        k.stride(1),
        v.data_ptr(),
        v.stride(0),
        v.stride(1),
        loc.data_ptr(),
        n,
        heads,
        dim,
        k.element_size(),
    )
