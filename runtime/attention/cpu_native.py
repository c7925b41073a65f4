"""The CPU default: decode through kvflow's native paged-attention kernel, extend through the
torch backend.

Decode reads each request's KV slots in place from the paged pool (no per-layer gather of
the contexts into padded tensors, which cost more than the attention itself); every KV head
is read once for the query heads that share it. Extends (prompts, chunks) stay on the torch
backend's batched matmuls, faster there for a hundred or more new tokens per request.
Needs a C compiler on first use (:mod:`kvflow.kernels.cpu.native`); ``attention_backend``
"auto" picks this backend on CPU only when the kernels build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.kernels.cpu import paged_attention, supports
from kvflow.runtime.attention.torch_native import TorchNativeBackend
from kvflow.runtime.forward_batch import ForwardBatch

__all__ = ["CpuNativeBackend"]


@dataclass(frozen=True)
class _DecodeMetadata:
    rows: torch.Tensor  # [B] int64 request-to-token row of each request
    visible: torch.Tensor  # [B] int64 context length, the new token included


class CpuNativeBackend(TorchNativeBackend):
    """Native decode kernel; extends inherited from :class:`TorchNativeBackend`."""

    def __init__(self, kv_pool, req_to_token, num_heads, num_kv_heads, head_dim, scale) -> None:
        super().__init__(kv_pool, req_to_token, num_heads, num_kv_heads, head_dim, scale)
        if kv_pool.k_buffer[0].device.type != "cpu":
            raise ValueError("the cpu attention backend runs on CPU only")
        if not supports(kv_pool.dtype, num_heads, num_kv_heads, head_dim):
            raise ValueError(
                f"the cpu attention backend takes float32 or bfloat16 with head_dim <= 256, "
                f"not {kv_pool.dtype}, head_dim {head_dim}: use --attention-backend torch"
            )

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if not fb.is_decode:
            super().init_forward_metadata(fb)
            return
        fb.attn_metadata = _DecodeMetadata(
            rows=fb.req_pool_indices.to(torch.int64),
            visible=torch.tensor(fb.seq_lens_cpu, dtype=torch.int64),
        )

    def forward_decode(self, q, k, v, layer_id, fb):
        meta: _DecodeMetadata = fb.attn_metadata
        return paged_attention(
            q,
            self.kv_pool.k_buffer[layer_id],
            self.kv_pool.v_buffer[layer_id],
            self.req_to_token.req_to_token,
            meta.rows,
            meta.visible,
            self.scale,
        )
