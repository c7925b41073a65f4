"""The CPU default: decode and extend through kvflow's native paged-attention kernel.

The kernel reads each request's KV slots in place from the paged pool (no per-layer gather
of the contexts into padded tensors, which cost more than the attention itself); every KV
head is read once for the query heads that share it, and for an extend once for a tile of
its new tokens (each new token sees its prefix and the new tokens up to itself; with a
sliding window, the last ``window`` of those, read from the window's first slot on). Needs a C
compiler on first use (:mod:`kvflow.kernels.cpu.build`); ``attention_backend`` "auto" picks
this backend on CPU only when the kernels build. Shapes or dtypes the kernel does not take
(float16, head_dim > 256, ...) run on the torch backend, with a warning. An FP8 KV cache is
read by the kernel itself (each FP8 row converted to float32 and scaled as it is loaded).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvflow.kernels.cpu import MAX_GROUP, MAX_HEAD_DIM, paged_attention, supports
from kvflow.runtime.attention.torch_backend import TorchBackend
from kvflow.runtime.forward_batch import ForwardBatch

__all__ = ["CpuKernelBackend"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _RowsMetadata:
    rows: torch.Tensor  # [N] int64 request-to-token row of each new token
    visible: torch.Tensor  # [N] int64 slots each new token sees (its own included)


def _extend_rows(fb: ForwardBatch) -> _RowsMetadata:
    """Per new token: its request's row, and prefix + its index in the extend + 1."""
    news = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64)
    starts = news.cumsum(0) - news  # first new token of each request in [N]
    first_visible = torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64) + 1 - starts
    return _RowsMetadata(
        rows=fb.req_pool_indices.to(torch.int64).repeat_interleave(news),
        visible=torch.arange(int(news.sum())) + first_visible.repeat_interleave(news),
    )


class CpuKernelBackend(TorchBackend):
    """Native kernel for decode and extend; the torch backend's paths where it does not
    apply (inherited from :class:`TorchBackend`)."""

    def __init__(
        self,
        kv_pool,
        req_to_token,
        num_heads,
        num_kv_heads,
        head_dim,
        scale,
        layer_windows=(),
        logit_cap=None,
        model_dtype=None,
    ) -> None:
        super().__init__(
            kv_pool,
            req_to_token,
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
            layer_windows,
            logit_cap,
            model_dtype,
        )
        if kv_pool.k_buffer[0].device.type != "cpu":
            raise ValueError("the cpu attention backend runs on CPU only")
        self.native = supports(self.model_dtype, num_heads, num_kv_heads, head_dim, kv_pool.dtype)
        if not self.native:
            log.warning(
                "native attention takes float32/bfloat16 models (float32, bfloat16 or FP8 KV), "
                "head_dim <= %d and <= %d query heads per KV head; %s over %s KV with %d/%d "
                "heads of %d runs on torch",
                MAX_HEAD_DIM,
                MAX_GROUP,
                self.model_dtype,
                kv_pool.dtype,
                num_heads,
                num_kv_heads,
                head_dim,
            )

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if not self.native:
            super().init_forward_metadata(fb)
        elif fb.is_decode:
            fb.attn_metadata = _RowsMetadata(
                rows=fb.req_pool_indices.to(torch.int64),
                visible=torch.tensor(fb.seq_lens_cpu, dtype=torch.int64),
            )
        else:
            fb.attn_metadata = _extend_rows(fb)

    def forward_decode(self, q, k, v, layer_id, fb):
        if not self.native:
            return super().forward_decode(q, k, v, layer_id, fb)
        return self._paged(q, layer_id, fb)

    def forward_extend(self, q, k, v, layer_id, fb):
        if not self.native:
            return super().forward_extend(q, k, v, layer_id, fb)
        return self._paged(q, layer_id, fb)

    def _paged(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        meta: _RowsMetadata = fb.attn_metadata
        return paged_attention(
            q,
            self.kv_pool.k_buffer[layer_id],
            self.kv_pool.v_buffer[layer_id],
            self.req_to_token.req_to_token,
            meta.rows,
            meta.visible,
            self.scale,
            window=self.window(layer_id),
            logit_cap=self.logit_cap,
            k_scale=self.kv_pool.k_scales[layer_id],
            v_scale=self.kv_pool.v_scales[layer_id],
        )
