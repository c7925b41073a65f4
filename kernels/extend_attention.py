"""Extend (prefill) attention: new ragged tokens over a cached prefix in the KV pool.

```
request i:   prefix (in the pool)                 new tokens (k_extend / v_extend)
             kv_indices[kv_indptr[i]:kv_indptr[i+1]]   rows qo_indptr[i]:qo_indptr[i+1]
new token j  sees all of the prefix                and new tokens 0..j (causal)
```

Grid (batch, num_q_heads, cdiv(max_len_extend, BLOCK_M)); each program runs one online
softmax over the prefix (gathered through ``kv_indices``), then over the new tokens before
its block (no masks) and finally over its diagonal block (causal mask). Programs past a
request's extend length return at once.

With a sliding ``window``, new token ``j`` (position ``prefix_len + j``) sees only keys
within ``window`` positions of itself (``q_pos - k_pos < window``, itself included): each
loop starts at the tile holding its block's first row's first key, so key tiles wholly
before every row's window are never read, and the rest are masked. A row may then have no
key in a tile, which the online softmax takes without NaN. With a ``logit_cap``, the
scaled scores are soft-capped (:mod:`kvflow.kernels.softcap`) before the masks.

The pool and the new tokens' K/V may hold another dtype than ``q`` (an FP8 KV cache: pass
the new tokens' K/V as stored): tiles are converted to ``q``'s dtype as they load,
``k_scale`` is folded into the score scale and ``v_scale`` into the output, for attention
over ``stored * scale``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels._launch import dot_precision, is_interpreted, next_power_of_2
from kvflow.kernels.logit_cap import softcap_ref
from kvflow.kernels.softcap import softcap

__all__ = ["extend_attention_fwd", "extend_attention_ref"]

_LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(qk, v, acc, m_i, l_i, DOT_PRECISION: tl.constexpr):
    """Fold one [BLOCK_M, BLOCK_N] tile of log2-scaled scores (and its values) into the
    running max ``m_i``, denominator ``l_i`` and numerator ``acc``. A row with every score
    -inf so far (no key seen yet) keeps zeros rather than NaN."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    q_ptr, k_ext_ptr, v_ext_ptr, o_ptr, k_buf_ptr, v_buf_ptr,
    qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
    scale_log2, v_scale, window, cap_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    kv_head = head // GROUP_SIZE

    ext_start = tl.load(qo_indptr_ptr + req)
    ext_len = tl.load(qo_indptr_ptr + req + 1) - ext_start
    if block_m * BLOCK_M >= ext_len:
        return
    prefix_start = tl.load(kv_indptr_ptr + req)
    prefix_len = tl.load(kv_indptr_ptr + req + 1) - prefix_start

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    rows = (ext_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Without a window: every new token sees all of the prefix, the new tokens below its
    # diagonal block all of them; with one, each loop starts at the tile holding the first
    # key the block's first row sees (first_key: a position; new token j is prefix_len + j).
    diag_start = block_m * BLOCK_M
    first_key = 0
    if SLIDING:
        first_key = tl.maximum(prefix_len + diag_start - window + 1, 0)
    q_pos = prefix_len + offs_m

    # Prefix tiles.
    for start_n in range((first_key // BLOCK_N) * BLOCK_N, prefix_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_len
        slots = tl.load(kv_indices_ptr + prefix_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        k_t = tl.load(
            k_buf_ptr + slots[None, :] * stride_kbt + kv_head * stride_kbh + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )
        v = tl.load(
            v_buf_ptr + slots[:, None] * stride_vbt + kv_head * stride_vbh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        k_t = k_t.to(q.dtype)  # the pool's dtype (FP8, ...) -> q's; a no-op when equal
        v = v.to(q.dtype)
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:  # in log2 units: cap_log2 = cap * log2(e)
            qk = softcap(qk, cap_log2)
        visible = mask_n[None, :]
        if SLIDING:
            visible = visible & (q_pos[:, None] - offs_n[None, :] < window)
        qk = tl.where(visible, qk, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(qk, v, acc, m_i, l_i, DOT_PRECISION)

    # New tokens below the diagonal block: without a window, every key visible to every
    # row, no masks.
    first_new = tl.maximum(first_key - prefix_len, 0)
    for start_n in range((first_new // BLOCK_N) * BLOCK_N, diag_start, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        cols = (ext_start + offs_n).to(tl.int64)
        k_t = tl.load(k_ext_ptr + cols[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                      mask=mask_d[:, None], other=0.0)  # fmt: skip
        v = tl.load(v_ext_ptr + cols[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=mask_d[None, :], other=0.0)  # fmt: skip
        k_t = k_t.to(q.dtype)  # the pool's dtype (FP8, ...) -> q's; a no-op when equal
        v = v.to(q.dtype)
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:  # in log2 units: cap_log2 = cap * log2(e)
            qk = softcap(qk, cap_log2)
        if SLIDING:
            qk = tl.where(offs_m[:, None] - offs_n[None, :] < window, qk, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(qk, v, acc, m_i, l_i, DOT_PRECISION)

    # The diagonal block, causal (and windowed). Each row sees at least itself.
    end_n = tl.minimum(diag_start + BLOCK_M, ext_len)
    for start_n in range(diag_start, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ext_len
        cols = (ext_start + offs_n).to(tl.int64)
        k_t = tl.load(
            k_ext_ptr + cols[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )
        v = tl.load(
            v_ext_ptr + cols[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        k_t = k_t.to(q.dtype)  # the pool's dtype (FP8, ...) -> q's; a no-op when equal
        v = v.to(q.dtype)
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:  # in log2 units: cap_log2 = cap * log2(e)
            qk = softcap(qk, cap_log2)
        visible = mask_n[None, :] & (offs_m[:, None] >= offs_n[None, :])
        if SLIDING:
            visible = visible & (offs_m[:, None] - offs_n[None, :] < window)
        qk = tl.where(visible, qk, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(qk, v, acc, m_i, l_i, DOT_PRECISION)

    tl.store(
        o_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        # padding rows past ext_len may have seen no key (l_i 0); they are not stored
        (acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]).to(o_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def _launch_config(head_dim: int, interpreted: bool, element_size: int = 2) -> dict[str, int]:
    """Tiles and warps: small tiles under the interpreter so that tests with small shapes
    still cross tile borders; Hopper-sized tiles on the GPU. 16-bit inputs pipeline three
    stages (1.39x on H100 in the tuning sweep); fp32 tiles would not fit shared memory."""
    if interpreted:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if head_dim <= 128:
        warps = 8 if head_dim > 64 else 4
        stages = 3 if element_size == 2 else 1
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": warps, "num_stages": stages}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1}


def extend_attention_fwd(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_len_extend: int,
    sm_scale: float,
    window: int | None = None,
    logit_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached prefix plus the new
    tokens themselves; writes ``o_extend`` and returns it.

    Shapes: ``q_extend``, ``o_extend`` [total_extend_tokens, num_q_heads, head_dim];
    ``k_extend``, ``v_extend`` [total_extend_tokens, num_kv_heads, head_dim];
    ``k_buffer``, ``v_buffer`` [num_token_slots, num_kv_heads, head_dim] (last dims
    contiguous). ``qo_indptr`` [batch + 1] int32 (new-token rows per request);
    ``kv_indptr`` [batch + 1] int32 and ``kv_indices`` int32 token slots of each request's
    cached prefix, which may be empty. ``max_len_extend`` (host int) bounds the longest
    request's new tokens; it sizes the grid. ``window``: a sliding window (see the module
    docstring); None: full causal attention. ``logit_cap``: soft-cap the scaled scores,
    ``cap * tanh(s / cap)`` (Gemma 2); None: none. Keys (pool and ``k_extend``) are read as
    ``stored * k_scale``, values as ``stored * v_scale``: with an FP8 pool, ``k_extend`` and
    ``v_extend`` are the new tokens' stored FP8 values.
    """
    num_q_heads, head_dim = q_extend.shape[1], q_extend.shape[2]
    num_kv_heads = k_extend.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} q heads is not a multiple of {num_kv_heads} kv heads")
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if logit_cap is not None and logit_cap <= 0:
        raise ValueError(f"logit_cap must be positive, got {logit_cap}")
    batch = qo_indptr.shape[0] - 1
    if batch == 0 or max_len_extend == 0:
        return o_extend
    interpreted = is_interpreted(_extend_kernel)
    config = _launch_config(head_dim, interpreted, q_extend.element_size())
    grid = (batch, num_q_heads, triton.cdiv(max_len_extend, config["BLOCK_M"]))
    _extend_kernel[grid](
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices,
        sm_scale * k_scale * _LOG2E, float(v_scale), window or 0, (logit_cap or 1.0) * _LOG2E,
        q_extend.stride(0), q_extend.stride(1), k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1), o_extend.stride(0), o_extend.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        GROUP_SIZE=num_q_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=max(next_power_of_2(head_dim), 16), SLIDING=window is not None,
        SOFTCAP=logit_cap is not None, UPCAST_DOT=interpreted, DOT_PRECISION=dot_precision(q_extend.dtype), **config,
    )  # fmt: skip
    return o_extend


def extend_attention_ref(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    logit_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Pure-torch extend attention (fp32 math, one request at a time, over ``stored.float()
    * scale``); returns a new tensor shaped like ``q_extend``. Same contract as
    :func:`extend_attention_fwd`."""
    group_size = q_extend.shape[1] // k_extend.shape[1]
    out = torch.empty_like(q_extend)
    qo_bounds, kv_bounds = qo_indptr.tolist(), kv_indptr.tolist()
    for req in range(len(qo_bounds) - 1):
        rows = slice(qo_bounds[req], qo_bounds[req + 1])
        slots = kv_indices[kv_bounds[req] : kv_bounds[req + 1]].long()
        extend_len, prefix_len = rows.stop - rows.start, slots.numel()
        if extend_len == 0:
            continue
        keys = torch.cat([k_buffer[slots].float(), k_extend[rows].float()]) * k_scale
        values = torch.cat([v_buffer[slots].float(), v_extend[rows].float()]) * v_scale
        keys = keys.repeat_interleave(group_size, dim=1)  # [prefix + extend, q_heads, d]
        values = values.repeat_interleave(group_size, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_extend[rows].float(), keys) * sm_scale
        scores = softcap_ref(scores, logit_cap)
        causal = torch.ones(
            extend_len, prefix_len + extend_len, dtype=torch.bool, device=q_extend.device
        ).tril(diagonal=prefix_len)
        if window is not None:  # q_pos - k_pos < window
            causal &= ~torch.ones_like(causal).tril(diagonal=prefix_len - window)
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values).to(q_extend.dtype)
    return out
