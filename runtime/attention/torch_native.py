"""Attention in plain torch; runs on CPU and CUDA, and is the CPU default.

Decode reads the paged KV cache with one ``index_select`` per buffer (advanced indexing
with a 2-D index is ~6x slower on CPU) and computes grouped-query attention as two batched
matmuls over ``[batch, kv_heads, group, ...]``, so each KV head is read once for all the
query heads that share it. ``scaled_dot_product_attention`` with a padding mask is avoided
there: on CPU it takes a slow path (bf16 worst, ~8x slower than the matmuls).
Extend uses SDPA per request; a request with no cached prefix attends over its new
``k``/``v`` directly, without reading them back from the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvflow.runtime.attention.base import AttentionBackend
from kvflow.runtime.forward_batch import ForwardBatch

__all__ = ["TorchNativeBackend"]


@dataclass(frozen=True)
class _ExtendPlan:
    q_starts: list[int]  # row offset of each request's new tokens in [N]
    prefix_slots: list[torch.Tensor | None]  # cached-prefix slots; None: no prefix
    masks: list[torch.Tensor | None]  # None: plain causal (no cached prefix)


@dataclass(frozen=True)
class _DecodePlan:
    flat_slots: torch.Tensor  # [B * max_len], each row padded with slot 0
    max_len: int
    bias: torch.Tensor  # [B, 1, 1, max_len] float32: 0 for real tokens, -inf for padding


class TorchNativeBackend(AttentionBackend):
    """Reference backend: SDPA per request for extend, one padded grouped matmul for decode."""

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        device = fb.input_ids.device
        if fb.is_decode:
            rows = [
                self.req_to_token.read(int(i), n)
                for i, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu, strict=True)
            ]
            max_len = max(fb.seq_lens_cpu)
            slots = torch.zeros((fb.batch_size, max_len), dtype=torch.int64, device=device)
            for b, row in enumerate(rows):
                slots[b, : row.numel()] = row
            lens = torch.tensor(fb.seq_lens_cpu, device=device)
            pad = torch.arange(max_len, device=device)[None, :] >= lens[:, None]
            bias = torch.zeros(pad.shape, dtype=torch.float32, device=device)
            bias.masked_fill_(pad, float("-inf"))
            fb.attn_metadata = _DecodePlan(slots.view(-1), max_len, bias[:, None, None, :])
            return
        starts: list[int] = []
        prefixes: list[torch.Tensor | None] = []
        masks: list[torch.Tensor | None] = []
        offset = 0
        for i, prefix_len, extend_len in zip(
            fb.req_pool_indices.tolist(),
            fb.extend_prefix_lens_cpu,
            fb.extend_seq_lens_cpu,
            strict=True,
        ):
            starts.append(offset)
            offset += extend_len
            if prefix_len == 0:
                prefixes.append(None)
                masks.append(None)
                continue
            prefixes.append(self.req_to_token.read(int(i), prefix_len))
            q_pos = torch.arange(prefix_len, prefix_len + extend_len, device=device)
            kv_pos = torch.arange(prefix_len + extend_len, device=device)
            masks.append(kv_pos[None, :] <= q_pos[:, None])
        fb.attn_metadata = _ExtendPlan(starts, prefixes, masks)

    def forward_extend(self, q, k, v, layer_id, fb):
        plan: _ExtendPlan = fb.attn_metadata
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        out = torch.empty_like(q)
        for start, prefix, mask, n in zip(
            plan.q_starts, plan.prefix_slots, plan.masks, fb.extend_seq_lens_cpu, strict=True
        ):
            ki, vi = k[start : start + n], v[start : start + n]
            if prefix is not None:
                ki = torch.cat([k_buf.index_select(0, prefix).to(q.dtype), ki])
                vi = torch.cat([v_buf.index_select(0, prefix).to(q.dtype), vi])
            oi = F.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
                ki.transpose(0, 1).unsqueeze(0),
                vi.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[start : start + n] = oi[0].transpose(0, 1)
        return out

    def forward_decode(self, q, k, v, layer_id, fb):
        plan: _DecodePlan = fb.attn_metadata
        batch, kv_heads, dim = q.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads

        def gather(buf: torch.Tensor) -> torch.Tensor:  # -> [B, kv_heads, max_len, D]
            rows = buf.index_select(0, plan.flat_slots).to(q.dtype)
            return rows.view(batch, plan.max_len, kv_heads, dim).transpose(1, 2).contiguous()

        keys, values = (
            gather(self.kv_pool.k_buffer[layer_id]),
            gather(self.kv_pool.v_buffer[layer_id]),
        )
        qg = q.view(batch, kv_heads, group, dim)
        scores = torch.matmul(qg, keys.transpose(2, 3)).float() * self.scale + plan.bias
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, values).view(batch, self.num_heads, dim)
