"""Triton GPU kernels of the runtime, each beside a pure-torch reference of its contract.

All kernel entry points take CUDA tensors (or CPU tensors when Triton's interpreter is on:
``TRITON_INTERPRET=1`` before a kernel's module is imported, on first use of one of its
names here). The references and :func:`build_cos_sin_cache` run anywhere. KV pools are per layer ``[num_token_slots,
num_kv_heads, head_dim]``, addressed by token-level slot indices in CSR form
(``kv_indptr`` / ``kv_indices``).
"""

from typing import TYPE_CHECKING

from kvflow.lazy import lazy_exports

if TYPE_CHECKING:
    from kvflow.kernels.activation import (
        gelu_tanh_and_mul,
        gelu_tanh_and_mul_ref,
        silu_and_mul,
        silu_and_mul_ref,
    )
    from kvflow.kernels.decode_attention import (
        MAX_KV_SPLITS,
        decode_attention_fwd,
        decode_attention_ref,
        decode_attention_table_fwd,
        decode_attention_table_ref,
        default_num_kv_splits,
    )
    from kvflow.kernels.extend_attention import extend_attention_fwd, extend_attention_ref
    from kvflow.kernels.fp8_gemm import (
        FP8_DTYPE,
        FP8_MAX,
        fp8_kernels_take,
        fp8_rowwise_mm,
        fp8_rowwise_mm_ref,
        per_token_group_quant_fp8,
        per_token_group_quant_fp8_ref,
        w8a8_block_fp8_matmul,
        w8a8_block_fp8_matmul_ref,
    )
    from kvflow.kernels.fp8_gemv import fp8_gemv, fp8_gemv_ref
    from kvflow.kernels.fused_moe import (
        MOE_SMALL_BATCH_MAX_PAIRS,
        ExpertScales,
        fused_moe,
        fused_moe_ref,
        moe_align_block_size,
    )
    from kvflow.kernels.fused_moe_small import SmallBatchConfig, fused_moe_small_batch
    from kvflow.kernels.gemv import gemv, gemv_ref
    from kvflow.kernels.kv_quant import (
        FP8_KV_DTYPES,
        dequantize_kv,
        is_fp8,
        quantize_kv,
        select_rows,
        store_kv_cache_ref,
    )
    from kvflow.kernels.kv_store import store_kv_cache
    from kvflow.kernels.logit_cap import softcap_ref
    from kvflow.kernels.lora import lora_expand, lora_shrink
    from kvflow.kernels.lora_ref import (
        lora_delta_masked,
        lora_delta_segments,
        lora_expand_ref,
        lora_shrink_dense,
        lora_shrink_ref,
    )
    from kvflow.kernels.rmsnorm import rmsnorm, rmsnorm_ref
    from kvflow.kernels.rope_cache import build_cos_sin_cache, rope_inv_freq
    from kvflow.kernels.rotary import rotary_embedding
    from kvflow.kernels.rotary_ref import rotary_embedding_ref
    from kvflow.kernels.sampling import top_k_top_p_sampling_from_probs, top_k_top_p_sampling_ref
else:  # torch-free until a name is used (kvflow.lazy)
    __getattr__ = lazy_exports(
        __name__,
        {
            ".activation": (
                "gelu_tanh_and_mul",
                "gelu_tanh_and_mul_ref",
                "silu_and_mul",
                "silu_and_mul_ref",
            ),
            ".decode_attention": (
                "MAX_KV_SPLITS",
                "decode_attention_fwd",
                "decode_attention_ref",
                "decode_attention_table_fwd",
                "decode_attention_table_ref",
                "default_num_kv_splits",
            ),
            ".extend_attention": ("extend_attention_fwd", "extend_attention_ref"),
            ".fp8_gemm": (
                "FP8_DTYPE",
                "FP8_MAX",
                "fp8_kernels_take",
                "fp8_rowwise_mm",
                "fp8_rowwise_mm_ref",
                "per_token_group_quant_fp8",
                "per_token_group_quant_fp8_ref",
                "w8a8_block_fp8_matmul",
                "w8a8_block_fp8_matmul_ref",
            ),
            ".fp8_gemv": ("fp8_gemv", "fp8_gemv_ref"),
            ".fused_moe": (
                "MOE_SMALL_BATCH_MAX_PAIRS",
                "ExpertScales",
                "fused_moe",
                "fused_moe_ref",
                "moe_align_block_size",
            ),
            ".fused_moe_small": ("SmallBatchConfig", "fused_moe_small_batch"),
            ".gemv": ("gemv", "gemv_ref"),
            ".kv_quant": (
                "FP8_KV_DTYPES",
                "dequantize_kv",
                "is_fp8",
                "quantize_kv",
                "select_rows",
                "store_kv_cache_ref",
            ),
            ".kv_store": ("store_kv_cache",),
            ".lora": ("lora_expand", "lora_shrink"),
            ".lora_ref": (
                "lora_delta_masked",
                "lora_delta_segments",
                "lora_expand_ref",
                "lora_shrink_dense",
                "lora_shrink_ref",
            ),
            ".rmsnorm": ("rmsnorm", "rmsnorm_ref"),
            ".rope_cache": ("build_cos_sin_cache", "rope_inv_freq"),
            ".rotary": ("rotary_embedding",),
            ".rotary_ref": ("rotary_embedding_ref",),
            ".sampling": ("top_k_top_p_sampling_from_probs", "top_k_top_p_sampling_ref"),
            ".logit_cap": ("softcap_ref",),
        },
    )

__all__ = [
    "FP8_DTYPE",
    "FP8_KV_DTYPES",
    "FP8_MAX",
    "MAX_KV_SPLITS",
    "MOE_SMALL_BATCH_MAX_PAIRS",
    "ExpertScales",
    "SmallBatchConfig",
    "build_cos_sin_cache",
    "decode_attention_fwd",
    "decode_attention_ref",
    "decode_attention_table_fwd",
    "decode_attention_table_ref",
    "default_num_kv_splits",
    "dequantize_kv",
    "extend_attention_fwd",
    "extend_attention_ref",
    "fp8_gemv",
    "fp8_gemv_ref",
    "fp8_kernels_take",
    "fp8_rowwise_mm",
    "fp8_rowwise_mm_ref",
    "fused_moe",
    "fused_moe_ref",
    "fused_moe_small_batch",
    "gelu_tanh_and_mul",
    "gelu_tanh_and_mul_ref",
    "gemv",
    "gemv_ref",
    "is_fp8",
    "lora_delta_masked",
    "lora_delta_segments",
    "lora_expand",
    "lora_expand_ref",
    "lora_shrink",
    "lora_shrink_dense",
    "lora_shrink_ref",
    "moe_align_block_size",
    "per_token_group_quant_fp8",
    "per_token_group_quant_fp8_ref",
    "quantize_kv",
    "rmsnorm",
    "rmsnorm_ref",
    "rope_inv_freq",
    "rotary_embedding",
    "rotary_embedding_ref",
    "select_rows",
    "silu_and_mul",
    "silu_and_mul_ref",
    "softcap_ref",
    "store_kv_cache",
    "store_kv_cache_ref",
    "top_k_top_p_sampling_from_probs",
    "top_k_top_p_sampling_ref",
    "w8a8_block_fp8_matmul",
    "w8a8_block_fp8_matmul_ref",
]
