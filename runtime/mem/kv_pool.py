"""The KV tensors themselves: one K and one V buffer per layer, indexed by KV slot."""

from __future__ import annotations

import mmap

import torch

from kvflow.kernels import cpu, store_kv_cache, store_kv_cache_ref

__all__ = ["KVPool"]


class KVPool:
    """Per-layer ``k_buffer[layer]`` / ``v_buffer[layer]`` of shape ``[num_slots, kv_heads, head_dim]``.

    ``num_slots`` includes the padding page (slot indices start at 0; see the allocator).
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
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

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * _size(dtype)

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[tokens, kv_heads, head_dim]`` at slots ``loc`` ``[tokens]``:
        the Triton kernel on CUDA, the native one on CPU (same dtype, kernels built), else
        index assignment."""
        k_buf, v_buf = self.k_buffer[layer_id], self.v_buffer[layer_id]
        if k.is_cuda:
            store_kv_cache(k_buf, v_buf, loc, k, v)
        elif cpu.elementwise.supports(k_buf, v_buf, k, v) and cpu.available():  # one dtype
            cpu.elementwise.store_kv(k_buf, v_buf, loc, k, v)
        else:
            store_kv_cache_ref(k_buf, v_buf, loc, k, v)

    def zero_slots(self, loc: torch.Tensor) -> None:
        """Zero K and V of every layer at slots ``loc`` ``[tokens]`` (int64, the pool's
        device), and wait for it: a PD decode clears the slots it reserved for a prompt
        before the prefill may write them, so a slot the transfer did not write holds no
        other request's KV."""
        for k_buf, v_buf in zip(self.k_buffer, self.v_buffer, strict=True):
            k_buf.index_fill_(0, loc, 0)
            v_buf.index_fill_(0, loc, 0)
        if loc.is_cuda:
            # NOTE: the peer writes these slots over the network, outside any CUDA stream:
            # the zeros must have landed before the decode claims the room.
            torch.cuda.current_stream(loc.device).synchronize()


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
