"""The CPU default: decode through kvflow's native paged-attention kernel, extend through the
torch backend.

Decode reads each request's KV slots in place from the paged pool (no per-layer gather of
the contexts into padded tensors, which cost more than the attention itself); every KV head
is read once for the query heads that share it. Extends (prompts, chunks) stay on the torch
backend's batched matmuls, faster there for a hundred or more new tokens per request.
Needs a C compiler on first use (:mod:`kvflow.kernels.cpu.native`); ``attention_backend``
"auto" picks this backend on CPU only when the kernels build. Shapes or dtypes the kernel
does not take (float16, head_dim > 256, ...) decode on the torch backend, with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvflow.kernels.cpu import paged_attention, supports
from kvflow.kernels.cpu.paged_attention import MAX_GROUP, MAX_HEAD_DIM
from kvflow.runtime.attention.torch_native import TorchNativeBackend
from kvflow.runtime.forward_batch import ForwardBatch

__all__ = ["CpuNativeBackend"]

log = logging.getLogger(__name__)


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
        self.native = supports(kv_pool.dtype, num_heads, num_kv_heads, head_dim)
        if not self.native:
            log.warning(
                "native decode attention takes float32/bfloat16, head_dim <= %d and <= %d query "
                "heads per KV head; %s with %d/%d heads of %d decodes on torch",
                MAX_HEAD_DIM,
                MAX_GROUP,
                kv_pool.dtype,
                num_heads,
                num_kv_heads,
                head_dim,
            )

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if not (fb.is_decode and self.native):
            super().init_forward_metadata(fb)
            return
        fb.attn_metadata = _DecodeMetadata(
            rows=fb.req_pool_indices.to(torch.int64),
            visible=torch.tensor(fb.seq_lens_cpu, dtype=torch.int64),
        )

    def forward_decode(self, q, k, v, layer_id, fb):
        if not self.native:
            return super().forward_decode(q, k, v, layer_id, fb)
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
