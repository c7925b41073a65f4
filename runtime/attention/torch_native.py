"""Attention in plain torch; runs on CPU and CUDA, and is the CPU default.

Decode reads the paged KV cache with one ``index_select`` per buffer (advanced indexing
with a 2-D index is ~6x slower on CPU) and computes grouped-query attention as two batched
matmuls over ``[batch, kv_heads, group, ...]``, so each KV head is read once for all the
query heads that share it. ``scaled_dot_product_attention`` with a padding mask is avoided
there: on CPU it takes a slow path (bf16 worst, ~8x slower than the matmuls).
Extend batches many short requests the same way (padded to the longest, one gather, a
causal bias), which on CPU is several times faster than one SDPA call per request; a batch
whose padded scores would not fit :data:`BATCHED_EXTEND_BYTES` (long prompts) uses SDPA per
request instead, attending over the new ``k``/``v`` directly when nothing is cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvflow.runtime.attention.base import AttentionBackend
from kvflow.runtime.forward_batch import ForwardBatch

__all__ = ["BATCHED_EXTEND_BYTES", "TorchNativeBackend"]

# Largest float32 score tensor ([requests, heads, new tokens, context]) batched extend builds.
BATCHED_EXTEND_BYTES = 64 << 20


@dataclass(frozen=True)
class _ExtendPlan:
    q_starts: list[int]  # row offset of each request's new tokens in [N]
    prefix_slots: list[torch.Tensor | None]  # cached-prefix slots; None: no prefix
    masks: list[torch.Tensor | None]  # None: plain causal (no cached prefix)


@dataclass(frozen=True)
class _BatchedExtendPlan:
    q_rows: torch.Tensor  # [R * max_new] row of q for each padded query position (pad: 0)
    out_rows: torch.Tensor  # [N] padded query position of each real row of q
    kv_slots: torch.Tensor  # [R * max_ctx] KV slots of each context (pad: slot 0)
    max_new: int
    max_ctx: int
    bias: torch.Tensor  # [R, 1, 1, max_new, max_ctx] float32: 0 where allowed, -inf elsewhere


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
        batched = self._batched_extend_plan(fb)
        if batched is not None:
            fb.attn_metadata = batched
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

    def _batched_extend_plan(self, fb: ForwardBatch) -> _BatchedExtendPlan | None:
        """Padded plan for the whole extend batch, or None when per-request SDPA is better."""
        news, prefixes = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        count = len(news)
        max_new = max(news)
        ctx = [p + n for p, n in zip(prefixes, news, strict=True)]
        max_ctx = max(ctx)
        if count < 2 or count * self.num_heads * max_new * max_ctx * 4 > BATCHED_EXTEND_BYTES:
            return None
        device = fb.input_ids.device
        q_rows = torch.zeros((count, max_new), dtype=torch.int64)
        out_rows = torch.empty(sum(news), dtype=torch.int64)
        kv_slots = torch.zeros((count, max_ctx), dtype=torch.int64, device=device)
        offset = 0
        for r, (i, n, c) in enumerate(zip(fb.req_pool_indices.tolist(), news, ctx, strict=True)):
            q_rows[r, :n] = torch.arange(offset, offset + n)
            out_rows[offset : offset + n] = torch.arange(r * max_new, r * max_new + n)
            kv_slots[r, :c] = self.req_to_token.read(int(i), c)
            offset += n
        q_pos = torch.arange(max_new)[None, :, None] + torch.tensor(prefixes)[:, None, None]
        kv_pos = torch.arange(max_ctx)[None, None, :]
        allowed = (kv_pos <= q_pos) & (kv_pos < torch.tensor(ctx)[:, None, None])
        bias = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, float("-inf"))
        return _BatchedExtendPlan(
            q_rows.view(-1).to(device),
            out_rows.to(device),
            kv_slots.view(-1),
            max_new,
            max_ctx,
            bias.to(device)[:, None, None],
        )

    def forward_extend(self, q, k, v, layer_id, fb):
        if isinstance(fb.attn_metadata, _BatchedExtendPlan):
            return self._batched_extend(q, layer_id, fb.attn_metadata)
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

    def _batched_extend(self, q: torch.Tensor, layer_id: int, plan: _BatchedExtendPlan):
        count = plan.kv_slots.numel() // plan.max_ctx
        kv_heads, dim = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        queries = (
            q.index_select(0, plan.q_rows)
            .view(count, plan.max_new, kv_heads, group, dim)
            .permute(0, 2, 3, 1, 4)
            .reshape(count, kv_heads, group * plan.max_new, dim)
        )
        keys = _gather_heads(self.kv_pool.k_buffer[layer_id], plan.kv_slots, count, q.dtype)
        values = _gather_heads(self.kv_pool.v_buffer[layer_id], plan.kv_slots, count, q.dtype)
        scores = torch.matmul(queries, keys.transpose(2, 3)).float()
        scores = scores.view(count, kv_heads, group, plan.max_new, plan.max_ctx)
        probs = torch.softmax(scores * self.scale + plan.bias, dim=-1).to(q.dtype)
        out = torch.matmul(probs.view(count, kv_heads, group * plan.max_new, plan.max_ctx), values)
        out = out.view(count, kv_heads, group, plan.max_new, dim).permute(0, 3, 1, 2, 4)
        return out.reshape(count * plan.max_new, self.num_heads, dim).index_select(0, plan.out_rows)

    def forward_decode(self, q, k, v, layer_id, fb):
        plan: _DecodePlan = fb.attn_metadata
        batch, kv_heads, dim = q.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads

        keys = _gather_heads(self.kv_pool.k_buffer[layer_id], plan.flat_slots, batch, q.dtype)
        values = _gather_heads(self.kv_pool.v_buffer[layer_id], plan.flat_slots, batch, q.dtype)
        qg = q.view(batch, kv_heads, group, dim)
        scores = torch.matmul(qg, keys.transpose(2, 3)).float() * self.scale + plan.bias
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, values).view(batch, self.num_heads, dim)


def _gather_heads(
    buf: torch.Tensor, flat_slots: torch.Tensor, count: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``flat_slots`` of a ``[slots, kv_heads, D]`` buffer as ``[count, kv_heads, L, D]``."""
    rows = buf.index_select(0, flat_slots).to(dtype)
    return rows.view(count, -1, buf.shape[1], buf.shape[2]).transpose(1, 2).contiguous()
