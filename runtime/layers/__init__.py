"""Building blocks of the native models (torch; Triton kernels are dispatched on CUDA)."""

from kvflow.runtime.layers.activation import silu_and_mul
from kvflow.runtime.layers.linear import (
    GateUpLinear,
    LinearBase,
    MergedColumnLinear,
    QKVLinear,
    ReplicatedLinear,
)
from kvflow.runtime.layers.matmul import PackedWeight, matmul_weight, pack_weight
from kvflow.runtime.layers.norm import RMSNorm
from kvflow.runtime.layers.quantization import (
    LINEAR_METHODS,
    LinearMethod,
    UnquantizedLinearMethod,
)
from kvflow.runtime.layers.rotary import RotaryEmbedding

__all__ = [
    "LINEAR_METHODS",
    "GateUpLinear",
    "LinearBase",
    "LinearMethod",
    "MergedColumnLinear",
    "PackedWeight",
    "QKVLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "UnquantizedLinearMethod",
    "matmul_weight",
    "pack_weight",
    "silu_and_mul",
]
