"""Attention in plain torch (``scaled_dot_product_attention``); runs on CPU and CUDA."""

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
    kv_slots: list[torch.Tensor]  # each request's full context slots
    masks: list[torch.Tensor | None]  # None: plain causal (no cached prefix)


@dataclass(frozen=True)
class _DecodePlan:
    kv_slots: torch.Tensor  # [B, max_len], padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, max_len] True where a real token


class TorchNativeBackend(AttentionBackend):
    """Reference backend: one SDPA call per request for extend, one padded call for decode."""

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        device = fb.input_ids.device
        rows = [
            self.req_to_token.read(int(i), n)
            for i, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu, strict=True)
        ]
        if fb.is_decode:
            max_len = max(fb.seq_lens_cpu)
            slots = torch.zeros((fb.batch_size, max_len), dtype=torch.int64, device=device)
            for b, row in enumerate(rows):
                slots[b, : row.numel()] = row
            lens = torch.tensor(fb.seq_lens_cpu, device=device)
            mask = torch.arange(max_len, device=device)[None, :] < lens[:, None]
            fb.attn_metadata = _DecodePlan(slots, mask[:, None, None, :])
            return
        starts: list[int] = []
        masks: list[torch.Tensor | None] = []
        offset = 0
        for prefix_len, extend_len in zip(
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, strict=True
        ):
            starts.append(offset)
            offset += extend_len
            if prefix_len == 0:
                masks.append(None)
                continue
            q_pos = torch.arange(prefix_len, prefix_len + extend_len, device=device)
            kv_pos = torch.arange(prefix_len + extend_len, device=device)
            masks.append(kv_pos[None, :] <= q_pos[:, None])
        fb.attn_metadata = _ExtendPlan(starts, rows, masks)

    def forward_extend(self, q, k, v, layer_id, fb):
        plan: _ExtendPlan = fb.attn_metadata
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        out = torch.empty_like(q)
        for start, slots, mask, n in zip(
            plan.q_starts, plan.kv_slots, plan.masks, fb.extend_seq_lens_cpu, strict=True
        ):
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = k_buf[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            vi = v_buf[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            oi = F.scaled_dot_product_attention(
                qi,
                ki,
                vi,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[start : start + n] = oi[0].transpose(0, 1)
        return out

    def forward_decode(self, q, k, v, layer_id, fb):
        plan: _DecodePlan = fb.attn_metadata
        kb = self.kv_pool.k_buffer[layer_id][plan.kv_slots].to(q.dtype)  # [B, L, Hkv, D]
        vb = self.kv_pool.v_buffer[layer_id][plan.kv_slots].to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            kb.transpose(1, 2),
            vb.transpose(1, 2),
            attn_mask=plan.mask,
            scale=self.scale,
            enable_gqa=True,
        )  # [B, H, 1, D]
        return out.squeeze(2)
