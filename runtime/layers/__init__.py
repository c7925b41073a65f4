"""Building blocks of the native models (torch; Triton kernels are dispatched on CUDA)."""

from kvflow.runtime.layers.activation import silu_and_mul
from kvflow.runtime.layers.linear import (
    PackedWeight,
    gate_up_silu,
    linear,
    matmul_weight,
    pack_linears,
    pack_weight,
)
from kvflow.runtime.layers.norm import RMSNorm
from kvflow.runtime.layers.rotary import RotaryEmbedding

__all__ = [
    "PackedWeight",
    "RMSNorm",
    "RotaryEmbedding",
    "gate_up_silu",
    "linear",
    "matmul_weight",
    "pack_linears",
    "pack_weight",
    "silu_and_mul",
]
