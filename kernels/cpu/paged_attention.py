"""Paged attention over the request-to-token table on CPU (``paged_attention.c``).

Contract: query row ``i`` (``q[i]``, ``[heads, dim]``) attends, causally by construction, to
the first ``visible[i]`` KV slots listed in row ``rows[i]`` of ``req_to_token``; K and V are
read in place from one layer's pool (``[slots, kv_heads, dim]``), query head ``j`` reading
KV head ``j // (heads // kv_heads)``. A row that sees no slot gets zeros. Decode is one row
per request with ``visible`` = its sequence length; an extend is one row per new token, token
``j`` of a request with ``p`` cached tokens seeing ``p + j + 1`` (the kernel attends such runs
of rows in tiles that share each block of K/V). With a sliding ``window``, row ``i`` sees only
the last ``window`` of its ``visible`` slots (keys within ``window`` positions of the query,
itself included), and the slots before are never read. With a ``logit_cap``, the scaled
scores are soft-capped, ``cap * tanh(s / cap)`` (Gemma 2), before the softmax. An FP8 pool
(an FP8 KV cache) is read as ``stored.float() * k_scale`` (``v_scale`` for V), in float32.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvflow.kernels.cpu.build import function
from kvflow.kernels.kv_quant import FP8_KV_DTYPES, dequantize_kv
from kvflow.kernels.logit_cap import softcap_ref

__all__ = ["MAX_GROUP", "MAX_HEAD_DIM", "paged_attention", "paged_attention_ref", "supports"]

MAX_HEAD_DIM = 256
MAX_GROUP = 32  # query heads per KV head (KVF_MAX_QHEADS in the C source)
DTYPES = (torch.float32, torch.bfloat16)  # of q and out
# of the pool, in the order of the C source's KVF_KV_* kinds (FP8 formats share one)
KV_DTYPES = (torch.float32, torch.bfloat16, *FP8_KV_DTYPES)

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ARGTYPES = [
    *(_PTR, _I64, _I64),  # q, strides
    *(_PTR, _PTR, _I64, _I64),  # k, v, strides
    *(_PTR, _I64),  # req_to_token, row stride
    *(_PTR, _PTR),  # rows, visible
    *(_PTR, _I64, _I64),  # out, strides
    *(_I64, _INT, _INT, _INT),  # n, heads, kv_heads, dim
    *(ctypes.c_float, _I64, ctypes.c_float, _INT),  # scale, window (0: none), cap, is_bf16
    *(_INT, _PTR, ctypes.c_float, ctypes.c_float),  # kv_kind, kv_lut, k_scale, v_scale
]


@functools.cache
def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """Every byte of an FP8 format as float32, by torch's own conversion (kept alive)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def supports(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype | None = None,
) -> bool:
    """Whether the kernel takes queries of ``dtype``, a pool of ``kv_dtype`` (None: the
    same) and these head shapes."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    return (
        dtype in DTYPES
        and kv_dtype in KV_DTYPES
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
    )


def paged_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    visible: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
    window: int | None = None,
    logit_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of every row of ``q`` ``[n, heads, dim]`` (see the module docstring); returns
    ``out`` (new if None) ``[n, heads, dim]`` in ``q``'s dtype.

    ``rows`` and ``visible`` are int64 ``[n]``; ``req_to_token`` is int32. Everything is on
    the CPU, and the head dimension of ``q``, ``out`` and the pools is contiguous. The pools
    are float32, bfloat16 or FP8 (then read times ``k_scale`` / ``v_scale``). Slots are
    not bounds-checked here: the caller's table must hold valid slots up to ``visible``.
    """
    n, heads, dim = q.shape
    kv_heads, kv_dtype = k_buffer.shape[1], k_buffer.dtype
    if not supports(q.dtype, heads, kv_heads, dim, kv_dtype):
        raise ValueError(
            f"unsupported: {q.dtype} over a {kv_dtype} pool, {heads} heads / {kv_heads} KV "
            f"heads, dim {dim}"
        )
    if out is None:
        out = torch.empty_like(q)
    tensors = {"q": q, "k_buffer": k_buffer, "v_buffer": v_buffer, "out": out}
    for name, t in tensors.items():
        dtype = kv_dtype if name.endswith("_buffer") else q.dtype
        if t.device.type != "cpu" or t.dtype != dtype or t.shape[-1] != dim or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a CPU {dtype} tensor with a contiguous head dim")
    if k_buffer.stride() != v_buffer.stride() or k_buffer.shape != v_buffer.shape:
        raise ValueError("k_buffer and v_buffer must have the same shape and strides")
    if req_to_token.dtype != torch.int32 or req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must be int32 with contiguous rows")
    if rows.dtype != torch.int64 or visible.dtype != torch.int64:
        raise ValueError("rows and visible must be int64")
    rows, visible = rows.contiguous(), visible.contiguous()
    if rows.numel() != n or visible.numel() != n:
        raise ValueError(f"rows and visible need {n} entries")
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if logit_cap is not None and logit_cap <= 0:
        raise ValueError(f"logit_cap must be positive, got {logit_cap}")
    if n == 0:
        return out
    fp8 = kv_dtype in FP8_KV_DTYPES
    table = _fp8_table(kv_dtype) if fp8 else None
    status = function("kvflow_paged_attention", _ARGTYPES, ctypes.c_int)(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k_buffer.data_ptr(),
        v_buffer.data_ptr(),
        k_buffer.stride(0),
        k_buffer.stride(1),
        req_to_token.data_ptr(),
        req_to_token.stride(0),
        rows.data_ptr(),
        visible.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        n,
        heads,
        kv_heads,
        dim,
        sm_scale,
        window or 0,
        logit_cap or 0.0,
        int(q.dtype == torch.bfloat16),
        min(KV_DTYPES.index(kv_dtype), 2),  # KVF_KV_F32, _BF16, _FP8
        None if table is None else table.data_ptr(),
        k_scale,
        v_scale,
    )
    if status != 0:
        raise MemoryError(f"paged_attention: no memory for the work list of {n} query rows")
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    visible: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    logit_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Pure-torch :func:`paged_attention` (float32 math, one row at a time)."""
    heads = q.shape[1]
    group = heads // k_buffer.shape[1]
    out = torch.zeros_like(q)
    for i, (row, length) in enumerate(zip(rows.tolist(), visible.tolist(), strict=True)):
        if length == 0:
            continue
        first = 0 if window is None else max(0, length - window)
        slots = req_to_token[row, first:length].long()
        keys = dequantize_kv(k_buffer[slots], k_scale, torch.float32)
        values = dequantize_kv(v_buffer[slots], v_scale, torch.float32)
        keys = keys.repeat_interleave(group, dim=1)  # [len, heads, dim]
        values = values.repeat_interleave(group, dim=1)
        scores = softcap_ref(torch.einsum("hd,thd->ht", q[i].float(), keys) * sm_scale, logit_cap)
        out[i] = torch.einsum("ht,thd->hd", scores.softmax(-1), values).to(q.dtype)
    return out
