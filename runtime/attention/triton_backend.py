"""Attention with kvflow's Triton kernels (paged decode with split-K, ragged extend).

Decode reads each request's KV slots straight from the request-to-token table (row
``req_pool_indices[i]``, first ``seq_lens[i]`` entries), so a decode step builds no
metadata: its CUDA graph replays from the five per-request inputs alone. A layer's sliding
window is a kernel argument (the same at capture and replay): decode reads only the window's
slots, extend skips the key tiles wholly before each block's windows. Soft-capping
(``logit_cap``) is a kernel argument as well. So are an FP8 KV cache's per-layer scales
(floats fixed after loading, so the captured graphs stay valid); the kernels load FP8 tiles
and convert them, and an extend reads its new tokens' K/V back from the pool as stored.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvflow.kernels import decode_attention_table_fwd, extend_attention_fwd
from kvflow.runtime.attention.base import AttentionBackend
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.host_copy import host_to_device

__all__ = ["TritonBackend"]


@dataclass(frozen=True)
class _Plan:
    """Extend metadata (decode needs none)."""

    kv_indptr: torch.Tensor  # [B + 1] int32 over each request's cached prefix
    kv_indices: torch.Tensor  # int32 token slots
    qo_indptr: torch.Tensor | None = None  # [B + 1] int32, extend only
    max_len_extend: int = 0


def _indptr(lengths: list[int], device: torch.device) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` (int32) on ``device``, from pinned memory (queued, no wait)."""
    return host_to_device([0, *itertools.accumulate(lengths)], str(device), torch.int32)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous, as the extend kernel needs (it
    takes the token and head strides): the q, k and v views of a merged QKV output reach it
    without a copy each (an eager prefill is bound by the host's launches)."""
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonBackend(AttentionBackend):
    """Default backend on CUDA (also runs on CPU under ``TRITON_INTERPRET=1`` for tests)."""

    def _gather_slots(self, fb: ForwardBatch, lengths: list[int]) -> torch.Tensor:
        """Concatenated ``req_to_token[row_i, :lengths[i]]`` (int32), without a device sync:
        the total is known on the host, so every shape is."""
        table = self.req_to_token.req_to_token
        total = sum(lengths)
        if total == 0:
            return torch.zeros(1, dtype=torch.int32, device=table.device)
        starts = _indptr(lengths, table.device).to(torch.int64)
        flat = torch.arange(total, device=table.device)
        owner = torch.searchsorted(starts[1:], flat, right=True)
        return table[fb.req_pool_indices[owner], flat - starts[owner]]

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.is_decode:
            fb.attn_metadata = None  # the table, req_pool_indices and seq_lens suffice
            return
        device = fb.input_ids.device
        prefix = fb.extend_prefix_lens_cpu
        fb.attn_metadata = _Plan(
            kv_indptr=_indptr(prefix, device),
            kv_indices=self._gather_slots(fb, prefix),
            qo_indptr=_indptr(fb.extend_seq_lens_cpu, device),
            max_len_extend=max(fb.extend_seq_lens_cpu),
        )

    # -- CUDA graphs (decode) ----------------------------------------------------------------
    def init_capture(self, max_bs: int) -> None:
        """Nothing to preallocate: captured decode graphs read the graph runner's static
        ``req_pool_indices`` / ``seq_lens`` and the table itself."""

    def fill_replay(self, fb: ForwardBatch, padded_bs: int) -> None:
        """Nothing to copy (see :meth:`init_capture`); padding rows (table row 0, length 1)
        read one valid slot and their output is dropped."""
        fb.attn_metadata = None

    def forward_extend(self, q, k, v, layer_id, fb):
        plan: _Plan = fb.attn_metadata
        out = q.new_empty(q.shape)  # contiguous, whatever q's strides
        pool = self.kv_pool
        k_buf, v_buf = pool.k_buffer[layer_id], pool.v_buffer[layer_id]
        if self.reads_stored_kv:  # the new tokens as the pool holds them (FP8, unscaled)
            k, v = pool.stored(layer_id, fb.out_cache_loc)
        extend_attention_fwd(
            _rows(q),
            _rows(k),
            _rows(v),
            out,
            k_buf,
            v_buf,
            plan.qo_indptr,
            plan.kv_indptr,
            plan.kv_indices,
            plan.max_len_extend,
            self.scale,
            self.window(layer_id),
            self.logit_cap,
            pool.k_scales[layer_id],
            pool.v_scales[layer_id],
        )
        return out

    def forward_decode(self, q, k, v, layer_id, fb):
        out = torch.empty_like(q)
        decode_attention_table_fwd(
            q.contiguous(),
            self.kv_pool.k_buffer[layer_id],
            self.kv_pool.v_buffer[layer_id],
            out,
            self.req_to_token.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            self.scale,
            window=self.window(layer_id),
            logit_cap=self.logit_cap,
            k_scale=self.kv_pool.k_scales[layer_id],
            v_scale=self.kv_pool.v_scales[layer_id],
        )
        return out
