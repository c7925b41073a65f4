"""Decode attention over the token-slot KV pool: one new query token per request.

Two stages, split-K over the sequence (flash-decoding):

```
stage 1  grid (batch, head_blocks, num_kv_splits)
         each program: the q heads of one KV group x one slice of the request's KV
         -> partial_o [batch, q_heads, splits, head_dim] (normalised), partial_lse (log2)
stage 2  grid (batch, q_heads): log-sum-exp merge of the non-empty splits -> o
```

Each request's slots come either from CSR ``kv_indptr``/``kv_indices`` or straight from
the request-to-token table (``decode_attention_table_fwd``: row ``req_pool_indices[i]``,
first ``seq_lens[i]`` entries), which needs no per-step index list. With a sliding
``window``, a request's slots are only its last ``window`` (the new token's own included):
both stages see that range alone, so the slots before it are never read. With a
``logit_cap``, the scaled scores are soft-capped (:mod:`kvflow.kernels.softcap`) before the
softmax.

The pool may store another dtype than ``q`` (an FP8 KV cache): its tiles are converted to
``q``'s dtype as they load (exact for FP8 into 16-bit floats), ``k_scale`` is folded into the
score scale and ``v_scale`` into the output, so the result is attention over ``stored *
scale``. Both are plain floats: under a CUDA graph they are fixed at capture, as the pool's
scales are once the model is loaded. With bfloat16 queries over an FP8 pool the tiles meet
in float16 instead (``KV_F16``): FP8 -> float16 is one conversion instruction per pair of
values, FP8 -> bfloat16 goes through float32, and on an H200 that conversion left the FP8
kernel as slow as the bf16 one at half the bytes. The queries are clamped to float16's
range (+-65,504) first; keys, values and the softmax weights in [0, 1] convert exactly or
more precisely than in bfloat16.

A request's slice length is ``cdiv(seq_len, num_kv_splits)`` rounded up to whole KV tiles
and to at least ``MIN_SPLIT_LEN``, computed on the device from ``kv_indptr``; short
requests therefore use fewer splits, and empty
splits are skipped by both stages. Nothing here reads device data on the host, and the
scratch sizes depend on shapes only, so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels._launch import (
    dot_precision,
    is_interpreted,
    multiprocessor_count,
    next_power_of_2,
)
from kvflow.kernels.logit_cap import softcap_ref
from kvflow.kernels.softcap import softcap

__all__ = [
    "MAX_KV_SPLITS",
    "decode_attention_fwd",
    "decode_attention_ref",
    "decode_attention_table_fwd",
    "decode_attention_table_ref",
    "default_num_kv_splits",
]

MAX_KV_SPLITS = 16
MIN_SPLIT_LEN = 64
_LOG2E = 1.4426950408889634


@triton.jit
def _split_len(seq_len, num_splits, MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens per split: whole tiles, at least MIN_SPLIT (a multiple of BLOCK_N)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)


@triton.jit
def _kv_range(meta_ptr, lens_ptr, batch, stride_table, window, TABLE: tl.constexpr,
              SLIDING: tl.constexpr):  # fmt: skip
    """Where request ``batch``'s slots start in ``kv_indices`` and how many there are: CSR
    (``meta`` = kv_indptr) or a table row (``meta`` = req_pool_indices, ``lens`` = seq_lens);
    ``SLIDING``: only the last ``window`` of them."""
    if TABLE:
        start = tl.load(meta_ptr + batch).to(tl.int64) * stride_table
        length = tl.load(lens_ptr + batch).to(tl.int32)
    else:
        start = tl.load(meta_ptr + batch).to(tl.int64)
        length = (tl.load(meta_ptr + batch + 1) - tl.load(meta_ptr + batch)).to(tl.int32)
    if SLIDING:
        before = tl.maximum(length - window, 0)
        start += before
        length -= before
    return start, length


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, kv_meta_ptr, kv_lens_ptr, kv_indices_ptr, part_o_ptr, part_lse_ptr,
    scale_log2, v_scale, stride_table, window, cap_log2,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    num_q_heads, num_splits,
    GROUP_SIZE: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr, TABLE: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_F16: tl.constexpr,
):  # fmt: skip
    batch = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head_block // tl.cdiv(GROUP_SIZE, BLOCK_H)

    offs_h = head_block * HEADS_PER_PROGRAM + tl.arange(0, BLOCK_H)
    mask_h = (offs_h < (head_block + 1) * HEADS_PER_PROGRAM) & (offs_h < num_q_heads)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    seq_start, seq_len = _kv_range(
        kv_meta_ptr, kv_lens_ptr, batch, stride_table, window, TABLE, SLIDING
    )
    split_len = _split_len(seq_len, num_splits, MIN_SPLIT, BLOCK_N)
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)
    if split_end > split_start:
        q = tl.load(
            q_ptr + batch * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        )
        if UPCAST_DOT:
            q = q.to(tl.float32)
        if KV_F16:
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        # NOTE: rows of padding heads (mask_h false) see q = 0, so their scores stay finite;
        # only key positions are masked with -inf, and every split has at least one key.
        e_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
        e_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < split_end
            slots = tl.load(kv_indices_ptr + seq_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            mask_nd = mask_n[None, :] & mask_d[:, None]
            k_t = tl.load(
                k_ptr + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                mask=mask_nd,
                other=0.0,
            )
            k_t = k_t.to(q.dtype)  # the pool's dtype (FP8, ...) -> q's; a no-op when equal
            qk = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
            if SOFTCAP:  # in log2 units: cap_log2 = cap * log2(e)
                qk = softcap(qk, cap_log2)
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            n_max = tl.maximum(tl.max(qk, 1), e_max)
            rescale = tl.exp2(e_max - n_max)
            p = tl.exp2(qk - n_max[:, None])
            v = tl.load(
                v_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            v = v.to(q.dtype)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            e_sum = e_sum * rescale + tl.sum(p, 1)
            e_max = n_max
        out_offs = batch * stride_ob + offs_h[:, None] * stride_oh + split * stride_os
        tl.store(
            part_o_ptr + out_offs + offs_d[None, :],
            acc * (v_scale / e_sum)[:, None],
            mask=mask_h[:, None] & mask_d[None, :],
        )
        tl.store(
            part_lse_ptr + batch * stride_lb + offs_h * stride_lh + split,
            e_max + tl.log2(e_sum),
            mask=mask_h,
        )


@triton.jit
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, o_ptr, kv_meta_ptr, kv_lens_ptr, window,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    TABLE: tl.constexpr, SLIDING: tl.constexpr,
):  # fmt: skip
    batch = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    _, seq_len = _kv_range(kv_meta_ptr, kv_lens_ptr, batch, 0, window, TABLE, SLIDING)
    split_len = _split_len(seq_len, num_splits, MIN_SPLIT, BLOCK_N)

    e_max = float("-inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in range(0, num_splits):
        if split * split_len < seq_len:
            lse = tl.load(part_lse_ptr + batch * stride_lb + head * stride_lh + split)
            part = tl.load(
                part_o_ptr + batch * stride_pb + head * stride_ph + split * stride_ps + offs_d,
                mask=mask_d,
                other=0.0,
            )
            n_max = tl.maximum(lse, e_max)
            rescale = tl.exp2(e_max - n_max)
            weight = tl.exp2(lse - n_max)
            acc = acc * rescale + weight * part
            e_sum = e_sum * rescale + weight
            e_max = n_max
    # An empty request (seq_len 0, e.g. CUDA-graph padding) gets zeros, not NaN.
    out = tl.where(seq_len > 0, acc / tl.maximum(e_sum, 1e-30), 0.0)
    tl.store(
        o_ptr + batch * stride_ob + head * stride_oh + offs_d,
        out.to(o_ptr.dtype.element_ty),
        mask=mask_d,
    )


def default_num_kv_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per request: a function of shapes only (constant for a captured batch size),
    between 1 and ``MAX_KV_SPLITS``, aiming at ~16 stage-1 programs per SM.

    NOTE: measured on H100 (Llama-3.1-8B heads), sweeping tiles x splits: the fastest
    configs at batch 8-160 used about half the splits of a 32-per-SM target (batch 160,
    ctx 2560: 2 splits, 580 us per layer against 616 us for the old default; batch 64,
    ctx 2048: 4 splits, 195 us against 216 us). One program per (request, KV head) leaves
    a ragged last wave.
    """
    if device.type != "cuda":
        return 4
    programs = batch * num_kv_heads
    target = 16 * multiprocessor_count(device.index or 0)
    return max(1, min(MAX_KV_SPLITS, triton.cdiv(target, max(programs, 1))))


def _launch_config(
    interpreted: bool, element_size: int = 2, kv_element_size: int = 2
) -> dict[str, int]:
    """Stage-1 tiles and pipelining; small tiles under the interpreter so that tests with
    small shapes still cross tile and split borders. fp32 keeps 2 stages (shared memory).

    NOTE: an FP8 pool (``kv_element_size`` 1) takes tiles of 128 keys: on an H200
    (``benchmarks/bench_kv_attention.py``, Llama-3.1-8B heads) 511 us a layer at batch 256
    x 2,560 tokens against 552 us with 64. bf16 pools keep 64 (128 was within 2% there)."""
    if interpreted:
        return {"BLOCK_N": 16, "MIN_SPLIT": 16, "num_warps": 4, "num_stages": 1}
    if kv_element_size == 1 and element_size <= 2:
        return {"BLOCK_N": 128, "MIN_SPLIT": 128, "num_warps": 4, "num_stages": 3}
    stages = 3 if element_size <= 2 else 2
    return {"BLOCK_N": 64, "MIN_SPLIT": MIN_SPLIT_LEN, "num_warps": 4, "num_stages": stages}


def _kv_f16(q: torch.Tensor, k_buffer: torch.Tensor, interpreted: bool) -> bool:
    """Whether bfloat16 queries meet an FP8 pool in float16 (see the module's docstring;
    the interpreter upcasts everything to float32 instead)."""
    return not interpreted and q.dtype == torch.bfloat16 and k_buffer.element_size() == 1


def _scratch(q, splits, partial_o, partial_lse):
    batch, num_q_heads, head_dim = q.shape
    if partial_o is None:
        partial_o = torch.empty(
            (batch, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
    if partial_lse is None:
        partial_lse = torch.empty(
            (batch, num_q_heads, splits), dtype=torch.float32, device=q.device
        )
    if partial_o.shape[2] < splits or partial_lse.shape[2] < splits:
        raise ValueError(f"scratch buffers hold fewer than {splits} splits")
    return partial_o, partial_lse


def _decode(q, k_buffer, v_buffer, o, meta, lens, kv_indices, stride_table, table, sm_scale,
            num_kv_splits, partial_o, partial_lse, window, logit_cap, k_scale,
            v_scale):  # fmt: skip
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} q heads is not a multiple of {num_kv_heads} kv heads")
    group_size = num_q_heads // num_kv_heads
    splits = num_kv_splits or default_num_kv_splits(batch, num_kv_heads, q.device)
    if not 1 <= splits <= MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits must be in [1, {MAX_KV_SPLITS}], got {splits}")
    partial_o, partial_lse = _scratch(q, splits, partial_o, partial_lse)
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if logit_cap is not None and logit_cap <= 0:
        raise ValueError(f"logit_cap must be positive, got {logit_cap}")
    sliding = window is not None
    if batch == 0:
        return o

    block_h = 16  # tl.dot needs >= 16 rows; a KV group's heads share one tile
    heads_per_program = min(block_h, group_size)
    block_d = max(next_power_of_2(head_dim), 16)
    interpreted = is_interpreted(_decode_partial_kernel)
    config = _launch_config(interpreted, q.element_size(), k_buffer.element_size())
    grid = (batch, triton.cdiv(num_q_heads, heads_per_program), splits)
    _decode_partial_kernel[grid](
        q, k_buffer, v_buffer, meta, lens, kv_indices, partial_o, partial_lse,
        sm_scale * k_scale * _LOG2E, float(v_scale), stride_table, window or 0,
        (logit_cap or 1.0) * _LOG2E,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        partial_o.stride(0), partial_o.stride(1), partial_o.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        num_q_heads, splits,
        GROUP_SIZE=group_size, HEADS_PER_PROGRAM=heads_per_program, BLOCK_H=block_h,
        HEAD_DIM=head_dim, BLOCK_D=block_d, TABLE=table, SLIDING=sliding,
        SOFTCAP=logit_cap is not None, UPCAST_DOT=interpreted,
        DOT_PRECISION=dot_precision(q.dtype), KV_F16=_kv_f16(q, k_buffer, interpreted), **config,
    )  # fmt: skip
    _decode_merge_kernel[(batch, num_q_heads)](
        partial_o, partial_lse, o, meta, lens, window or 0,
        partial_o.stride(0), partial_o.stride(1), partial_o.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), o.stride(0), o.stride(1),
        splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        MIN_SPLIT=config["MIN_SPLIT"], BLOCK_N=config["BLOCK_N"], TABLE=table, SLIDING=sliding,
        num_warps=4 if head_dim <= 128 else 8,
    )  # fmt: skip
    return o


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int | None = None,
    *,
    partial_o: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
    window: int | None = None,
    logit_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of one new token per request over its KV in the pool; writes ``o``.

    Shapes: ``q``, ``o`` [batch, num_q_heads, head_dim] (last dim contiguous);
    ``k_buffer``, ``v_buffer`` [num_token_slots, num_kv_heads, head_dim];
    ``kv_indptr`` [batch + 1] int32; ``kv_indices`` [>= kv_indptr[-1]] int32 token slots,
    request ``i`` attending to slots ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`` (the new
    token's own KV included, already stored). ``num_q_heads`` must be a multiple of
    ``num_kv_heads`` (GQA). ``num_kv_splits`` (1..MAX_KV_SPLITS) defaults to
    :func:`default_num_kv_splits`. ``partial_o`` [batch, num_q_heads, >= splits, head_dim]
    and ``partial_lse`` [batch, num_q_heads, >= splits] (fp32) are optional scratch buffers,
    e.g. preallocated once for CUDA-graph capture. ``window``: attend only to the last
    ``window`` slots of each request (sliding-window attention). ``logit_cap``: soft-cap
    the scaled scores, ``cap * tanh(s / cap)`` (Gemma 2); None: none. The pools may hold
    another dtype than ``q`` (FP8: an FP8 KV cache), read as ``stored * k_scale`` (keys) and
    ``stored * v_scale`` (values). Returns ``o``.
    """
    return _decode(q, k_buffer, v_buffer, o, kv_indptr, kv_indptr, kv_indices, 0, False,
                   sm_scale, num_kv_splits, partial_o, partial_lse, window,
                   logit_cap, k_scale, v_scale)  # fmt: skip


def decode_attention_table_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int | None = None,
    *,
    partial_o: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
    window: int | None = None,
    logit_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """:func:`decode_attention_fwd` reading each request's slots straight from the
    request-to-token table: request ``i`` attends to
    ``req_to_token[req_pool_indices[i], :seq_lens[i]]`` (``req_to_token`` [rows, max_len]
    int32 with contiguous rows; ``req_pool_indices``, ``seq_lens`` [batch] int32/int64).
    No per-step index list is built, so a decode step needs no metadata kernels."""
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token rows must be contiguous")
    return _decode(q, k_buffer, v_buffer, o, req_pool_indices, seq_lens, req_to_token,
                   req_to_token.stride(0), True, sm_scale, num_kv_splits, partial_o,
                   partial_lse, window, logit_cap, k_scale, v_scale)  # fmt: skip


def decode_attention_table_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    logit_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Pure-torch :func:`decode_attention_table_fwd` (through :func:`decode_attention_ref`)."""
    rows, lens = req_pool_indices.tolist(), seq_lens.tolist()
    parts = [req_to_token[row, :length] for row, length in zip(rows, lens, strict=True)]
    kv_indices = torch.cat(parts) if parts else req_to_token.new_zeros(0)
    kv_indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    kv_indptr[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return decode_attention_ref(
        q, k_buffer, v_buffer, kv_indptr, kv_indices, sm_scale, window, logit_cap, k_scale, v_scale
    )


def decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    logit_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Pure-torch decode attention (fp32 math, one request at a time, over ``stored.float()
    * scale``); returns a new [batch, num_q_heads, head_dim] tensor in ``q``'s dtype. Same
    contract as :func:`decode_attention_fwd`."""
    batch, num_q_heads, _ = q.shape
    group_size = num_q_heads // k_buffer.shape[1]
    out = torch.zeros_like(q)
    bounds = kv_indptr.tolist()
    for req in range(batch):
        slots = kv_indices[bounds[req] : bounds[req + 1]].long()
        if window is not None:
            slots = slots[-window:]
        if slots.numel() == 0:
            continue
        keys = (k_buffer[slots].float() * k_scale).repeat_interleave(group_size, dim=1)
        values = (v_buffer[slots].float() * v_scale).repeat_interleave(group_size, dim=1)
        scores = torch.einsum("hd,thd->ht", q[req].float(), keys) * sm_scale
        scores = softcap_ref(scores, logit_cap)
        probs = torch.softmax(scores, dim=-1)
        out[req] = torch.einsum("ht,thd->hd", probs, values).to(q.dtype)
    return out
