"""Building blocks of the native models (torch; Triton kernels are dispatched on CUDA)."""

from typing import TYPE_CHECKING

from kvflow.lazy import lazy_exports

if TYPE_CHECKING:
    from kvflow.runtime.layers.activation import gelu_tanh_and_mul, silu_and_mul
    from kvflow.runtime.layers.linear import (
        GateUpLinear,
        LinearBase,
        MergedColumnLinear,
        QKVLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from kvflow.runtime.layers.matmul import CpuMatmul, PackedWeight, matmul_weight, pack_weight
    from kvflow.runtime.layers.moe import Experts, ExpertWeights, SparseMoE
    from kvflow.runtime.layers.moe_compute import TopK, fused_experts_ref, select_experts
    from kvflow.runtime.layers.norm import GemmaRMSNorm, RMSNorm
    from kvflow.runtime.layers.quantization import (
        LINEAR_METHODS,
        LinearMethod,
        UnquantizedLinearMethod,
    )
    from kvflow.runtime.layers.rotary import RotaryEmbedding
    from kvflow.runtime.layers.vocab import ParallelLMHead, VocabParallelEmbedding, gather_logits
else:  # torch-free until a name is used (kvflow.lazy)
    __getattr__ = lazy_exports(
        __name__,
        {
            ".activation": ("gelu_tanh_and_mul", "silu_and_mul"),
            ".linear": (
                "GateUpLinear",
                "LinearBase",
                "MergedColumnLinear",
                "QKVLinear",
                "ReplicatedLinear",
                "RowParallelLinear",
            ),
            ".matmul": ("CpuMatmul", "PackedWeight", "matmul_weight", "pack_weight"),
            ".moe": ("ExpertWeights", "Experts", "SparseMoE"),
            ".moe_compute": ("TopK", "fused_experts_ref", "select_experts"),
            ".norm": ("GemmaRMSNorm", "RMSNorm"),
            ".quantization": ("LINEAR_METHODS", "LinearMethod", "UnquantizedLinearMethod"),
            ".rotary": ("RotaryEmbedding",),
            ".vocab": ("ParallelLMHead", "VocabParallelEmbedding", "gather_logits"),
        },
    )

__all__ = [
    "LINEAR_METHODS",
    "CpuMatmul",
    "ExpertWeights",
    "Experts",
    "GateUpLinear",
    "GemmaRMSNorm",
    "LinearBase",
    "LinearMethod",
    "MergedColumnLinear",
    "PackedWeight",
    "ParallelLMHead",
    "QKVLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SparseMoE",
    "TopK",
    "UnquantizedLinearMethod",
    "VocabParallelEmbedding",
    "fused_experts_ref",
    "gather_logits",
    "gelu_tanh_and_mul",
    "matmul_weight",
    "pack_weight",
    "select_experts",
    "silu_and_mul",
]
