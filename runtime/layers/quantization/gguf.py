"""GGUF block weights (Q8_0, Q4_1) served as the file stores them, on CPU: dequantized
inside the native matmul (:mod:`kvflow.kernels.cpu.qgemm`), not at load."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvflow.kernels.cpu import qgemm
from kvflow.runtime.layers.quantization.base import LinearLayer, LinearMethod
from kvflow.runtime.layers.quantization.config import GgufScheme

__all__ = ["GgufLinearMethod", "QuantEmbedding", "QuantHead"]

_PACKED = "gguf_packed"


class QuantHead:
    """A tied LM head kept in its GGUF blocks (the token embedding's), with the
    ``takes``/``matmul`` of :class:`~kvflow.runtime.layers.matmul.PackedWeight`."""

    def __init__(self, packed: qgemm.QuantPacked) -> None:
        self.packed = packed

    def takes(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _matmul(self.packed, x)


class QuantEmbedding(nn.Module):
    """The token embedding read from a tied :class:`QuantHead`'s Q8_0 panels: ``ids`` ->
    ``[*ids.shape, hidden]`` in ``dtype``, the rows the dequantized float embedding held
    (:func:`~kvflow.kernels.cpu.qgemm.dequantize_rows`), so that embedding is not kept.
    No parameters: loading skips it."""

    def __init__(self, head: QuantHead, dtype: torch.dtype) -> None:
        super().__init__()
        if not self.reads(head):
            raise ValueError(f"no row reads from {head.packed.block_type} panels")
        self.head, self.dtype = head, dtype

    @staticmethod
    def reads(head: QuantHead) -> bool:
        """Whether rows can be read from ``head``'s panels (Q8_0)."""
        return head.packed.block_type == "Q8_0"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return qgemm.dequantize_rows(self.head.packed, ids, self.dtype)


def _matmul(packed: qgemm.QuantPacked, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if packed.takes(rows):
        out = qgemm.qgemm(rows, packed)
    else:  # float16, or float32 rows on bfloat16 panels: run them in a dtype it takes
        out = qgemm.qgemm(rows.to(packed.dtypes[0]), packed).to(x.dtype)
    return out.view(*x.shape[:-1], packed.n)


class GgufLinearMethod(LinearMethod):
    """``weight``: uint8 ``[N, K / 32 * block bytes]``, GGUF's rows of blocks of
    ``scheme.block_type`` (a merged layer's shards stacked by rows, as the float weight's);
    ``bias`` ``[N]`` in the model's dtype. After loading, the blocks are repacked into the
    kernel's panels for the model's dtype, which replace ``weight`` (so weights load again
    only into a fresh model), and :meth:`apply` runs the native matmul on any row count.
    CPU only (the CLI refuses CUDA); tensor parallelism would split rows of blocks, which is
    not built."""

    def __init__(self, scheme: GgufScheme) -> None:
        self.block_type = scheme.block_type
        if self.block_type not in qgemm.BLOCK_TYPES:
            raise ValueError(f"GGUF {self.block_type} has no native kernel")

    def create_weights(
        self,
        layer: LinearLayer,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
    ) -> None:
        block_bytes = qgemm.BLOCK_TYPES[self.block_type][0]
        if input_size % qgemm.BLOCK:
            raise ValueError(f"GGUF rows of {input_size} columns are not whole blocks")
        row_bytes = input_size // qgemm.BLOCK * block_bytes
        weight = torch.empty(sum(output_sizes), row_bytes, dtype=torch.uint8)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        layer.param_dtypes["weight"] = torch.uint8
        bias_param = nn.Parameter(torch.empty(sum(output_sizes)), requires_grad=False)
        layer.register_parameter("bias", bias_param if bias else None)
        setattr(layer, _PACKED, None)

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        packed = qgemm.pack(layer.weight.data, self.block_type, layer.compute_dtype)
        layer.weight = nn.Parameter(packed.panels, requires_grad=False)
        setattr(layer, _PACKED, packed)

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        packed: qgemm.QuantPacked | None = layer.__dict__[_PACKED]
        if packed is None:
            raise RuntimeError("GGUF layer used before process_weights_after_loading")
        out = _matmul(packed, x)
        return out if layer.bias is None else out + layer.bias
