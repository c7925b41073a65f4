"""The matmuls under the linear layers: one-token inputs on CUDA take the Triton GEMV; on CPU,
weights packed once (:func:`pack_weight`, after loading) run through kvflow's native matmul
(:mod:`kvflow.kernels.cpu.gemm`) and/or oneDNN's prepacked linear, skipping the per-call
reorder that ``F.linear`` pays.

Which CPU path runs (measured on the 2-core EPYC with SmolLM2-135M's projections,
``benchmarks/results/cpu-kernels.md``): bfloat16 takes the native kernel at every row count
(1.15-1.4x oneDNN at 32 rows, a decode step; 1.03-1.2x at 2048); float32 takes it up to
:data:`NATIVE_MAX_ROWS` rows (1.1-1.25x at 32) and oneDNN above (0.95-1.2x per projection
at 2048 there, and 10% ahead of the native kernel over 30 layers' weights in a sweep at
128-2048 rows), so a float32 weight keeps both packed copies. The
packed copies sit beside the weight (which loading, the embedding of tied heads and other
devices still read): a CPU weight takes two (bfloat16) or three (float32) times its memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvflow import kernels
from kvflow.kernels import cpu

__all__ = [
    "NATIVE_MAX_ROWS",
    "CpuMatmul",
    "PackedWeight",
    "matmul_weight",
    "one_row",
    "pack_weight",
]

ONEDNN_TYPES = (torch.float32, torch.bfloat16)
# oneDNN picks the blocked layout for an expected row count; decode batches are the
# steady state and the layout chosen for them is as fast for prefill chunks too.
PACK_ROWS_HINT = 32
NATIVE_MAX_ROWS = 128  # float32 row blocks above this go to oneDNN when it is packed


class CpuMatmul(Protocol):
    """A weight prepared for CPU matmuls: :class:`PackedWeight`, or a quantized one (the
    GGUF head, :class:`~kvflow.runtime.layers.quantization.gguf.QuantHead`)."""

    def takes(self, x: torch.Tensor) -> bool:
        """Whether :meth:`matmul` runs ``x``."""
        ...

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``."""
        ...


@dataclass(frozen=True)
class PackedWeight:
    """A CPU weight ``[out_features, K]`` packed for the matmuls that run it: the native
    kernel's panels and/or oneDNN's blocked layout (at least one is set). ``silu_mul``: a
    merged ``[gate; up]`` whose native panels interleave gate and up, so the native matmul
    yields ``silu(gate) * up`` (:meth:`silu_mul_matmul`) and not the plain product."""

    out_features: int
    dtype: torch.dtype
    native: torch.Tensor | None
    onednn: torch.Tensor | None
    silu_mul: bool = False

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.device.type == "cpu"

    def native_for(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s row count runs on the native matmul (else on oneDNN)."""
        rows = x.numel() // x.shape[-1]
        return self.native is not None and (self.onednn is None or rows <= NATIVE_MAX_ROWS)

    def plain_for(self, x: torch.Tensor) -> bool:
        """Whether :meth:`matmul` can run ``x`` (a ``silu_mul`` weight only on oneDNN)."""
        return not (self.silu_mul and self.native_for(x))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for ``x`` ``[..., K]`` of the packed dtype on CPU, where
        :meth:`plain_for` says so."""
        rows = x.reshape(-1, x.shape[-1])
        if self.native_for(x) and not self.silu_mul:
            out = cpu.gemm.gemm(_unit_stride(rows), self.native, self.out_features, bias=bias)
        elif self.onednn is not None:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.onednn, bias, "none", [], "")
        else:
            raise ValueError("this weight is packed for the fused SwiGLU: use silu_mul_matmul")
        return out.view(*x.shape[:-1], self.out_features)

    def silu_mul_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``x @ [gate; up].T`` in one native matmul (``silu_mul``
        weights, where :meth:`native_for` holds)."""
        rows = x.reshape(-1, x.shape[-1])
        out = cpu.gemm.gemm(_unit_stride(rows), self.native, self.out_features, silu_mul=True)
        return out.view(*x.shape[:-1], self.out_features // 2)


def _unit_stride(rows: torch.Tensor) -> torch.Tensor:
    return rows if rows.stride(1) == 1 else rows.contiguous()


def one_row(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1


def pack_weight(weight: torch.Tensor, silu_mul: bool = False) -> PackedWeight | None:
    """``weight`` [N, K] packed for CPU matmuls (see the module docstring for which layouts),
    or None where neither applies (not on CPU, another dtype, no native kernels and torch
    built without oneDNN). ``silu_mul``: ``weight`` is a merged ``[gate; up]``; its native
    panels are packed for the fused SwiGLU where the kernel takes them."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    native = None
    if cpu.available() and cpu.gemm.supports(weight):
        silu_mul = silu_mul and cpu.gemm.supports(weight, silu_mul=True)
        native = cpu.gemm.pack(weight.detach(), silu_mul=silu_mul)
    else:
        silu_mul = False
    onednn = None
    wants_onednn = native is None or weight.dtype == torch.float32
    if wants_onednn and weight.dtype in ONEDNN_TYPES and torch.backends.mkldnn.is_available():
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
    if native is None and onednn is None:
        return None
    return PackedWeight(weight.shape[0], weight.dtype, native, onednn, silu_mul)


def matmul_weight(
    x: torch.Tensor, weight: torch.Tensor, packed: CpuMatmul | None = None
) -> torch.Tensor:
    """``x @ weight.T`` for ``weight`` [N, K]: a single row ``x`` [1, K] on CUDA streams the
    weight once with :func:`kvflow.kernels.gemv` (faster than cuBLAS at M=1 on H100); a CPU
    ``x`` uses ``packed`` (:func:`pack_weight` of ``weight``) when given; everything else
    goes to ``F.linear``."""
    if one_row(x):
        return kernels.gemv(x, weight)
    if packed is not None and packed.takes(x):
        return packed.matmul(x)
    return F.linear(x, weight)
