"""The KV tensors themselves: one K and one V buffer per layer, indexed by KV slot."""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

from kvflow import kernels
from kvflow.kernels import cpu, dequantize_kv, is_fp8, select_rows, store_kv_cache_ref
from kvflow.runtime.layers.quantization import KVScales

__all__ = ["KVPool"]


class KVPool:
    """Per-layer ``k_buffer[layer]`` / ``v_buffer[layer]`` of shape ``[num_slots, kv_heads, head_dim]``.

    ``num_slots`` includes the padding page (slot indices start at 0; see the allocator).
    ``dtype`` is the storage type (``--kv-cache-dtype``), which may differ from the
    model's. An FP8 pool stores ``x / k_scales[layer]`` (``v_scales`` for V) rounded to
    FP8 and is read as ``stored * scale`` (:mod:`kvflow.kernels.kv_quant`); other pools
    ignore ``scales`` (theirs are 1.0).
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
        scales: KVScales | None = None,
    ) -> None:
        shape = (num_slots, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            # NOTE: one anonymous mapping holds every layer's K and V: the kernel hands out
            # its pages zeroed and only when first written, so the process's resident memory
            # grows with the tokens in use, not with the pool's size (torch.zeros would touch
            # every page at start-up).
            self._mapping = mmap.mmap(
                -1, 2 * num_layers * shape[0] * shape[1] * shape[2] * _size(dtype)
            )
            whole = torch.frombuffer(self._mapping, dtype=dtype).view(2, num_layers, *shape)
            self.k_buffer = list(whole[0].unbind(0))
            self.v_buffer = list(whole[1].unbind(0))
        else:
            self.k_buffer = [
                torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
            ]
            self.v_buffer = [
                torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
            ]
        self.dtype = dtype
        if scales is None or not is_fp8(dtype):
            scales = KVScales.ones(num_layers)
        if len(scales.k) != num_layers or len(scales.v) != num_layers:
            raise ValueError(f"KV scales for {len(scales.k)} layers, the pool has {num_layers}")
        self.k_scales, self.v_scales = scales.k, scales.v

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.dtype)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * _size(dtype)

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[tokens, kv_heads, head_dim]`` at slots ``loc`` ``[tokens]``,
        rounded to the pool's dtype with the layer's scales: the Triton kernel on CUDA, the
        native one on CPU (same dtype, kernels built), else index assignment."""
        k_buf, v_buf = self.k_buffer[layer_id], self.v_buffer[layer_id]
        k_scale, v_scale = self.k_scales[layer_id], self.v_scales[layer_id]
        if k.is_cuda:
            kernels.store_kv_cache(k_buf, v_buf, loc, k, v, k_scale, v_scale)  # Triton
        elif cpu.elementwise.supports(k_buf, v_buf, k, v) and cpu.available():  # one dtype
            cpu.elementwise.store_kv(k_buf, v_buf, loc, k, v)
        else:
            store_kv_cache_ref(k_buf, v_buf, loc, k, v, k_scale, v_scale)

    def stored(self, layer_id: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[tokens, kv_heads, head_dim]`` at slots ``loc`` as stored (pool dtype,
        unscaled)."""
        return select_rows(self.k_buffer[layer_id], loc), select_rows(self.v_buffer[layer_id], loc)

    def read(
        self, layer_id: int, loc: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[tokens, kv_heads, head_dim]`` at slots ``loc`` as attention sees them,
        in ``dtype`` (dequantized with the layer's scales)."""
        k, v = self.stored(layer_id, loc)
        return (
            dequantize_kv(k, self.k_scales[layer_id], dtype),
            dequantize_kv(v, self.v_scales[layer_id], dtype),
        )

    def zero_slots(self, loc: torch.Tensor, extra: Sequence[torch.Tensor] = ()) -> None:
        """Zero K and V of every layer at slots ``loc`` ``[tokens]`` (int64, the pool's
        device), and the rows ``loc`` of ``extra`` (other per-slot buffers: an EAGLE
        target's features), and wait for it: a PD decode clears the slots it reserved for a
        prompt before the prefill may write them, so a slot the transfer did not write holds
        no other request's KV."""
        # as bytes: index_fill_ has no float8 kernel on CPU; zero bits are 0.0 anyway
        buffers = [buf.view(torch.uint8) for buf in (*self.k_buffer, *self.v_buffer, *extra)]
        runs = None if loc.is_cuda else _runs(loc)
        if runs is not None:
            # NOTE: a slice per run of consecutive slots: index_fill_ runs on the OpenMP
            # pool, which stalls for milliseconds when another process keeps the cores busy
            # (a PD prefill beside its decode), and the decode's claim waits for these zeros
            for begin, end in runs:
                for buf in buffers:
                    buf[begin:end].zero_()
            return
        for buf in buffers:
            buf.index_fill_(0, loc, 0)
        if loc.is_cuda:
            # NOTE: the peer writes these slots over the network, outside any CUDA stream:
            # the zeros must have landed before the decode claims the room.
            torch.cuda.current_stream(loc.device).synchronize()


_MAX_RUNS = 64  # more runs than this (scattered slots) are zeroed by one index_fill_


def _runs(loc: torch.Tensor) -> list[tuple[int, int]] | None:
    """``loc`` as ``[begin, end)`` runs of consecutive slots, in order; None if there are
    more than :data:`_MAX_RUNS`."""
    if loc.numel() == 0:
        return []
    cuts = torch.nonzero(loc[1:] != loc[:-1] + 1).flatten() + 1
    if len(cuts) >= _MAX_RUNS:
        return None
    firsts = [0, *cuts.tolist()]
    lasts = [cut - 1 for cut in firsts[1:]] + [loc.numel() - 1]
    begins, ends = loc[firsts].tolist(), loc[lasts].tolist()
    return [(begin, end + 1) for begin, end in zip(begins, ends, strict=True)]


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
