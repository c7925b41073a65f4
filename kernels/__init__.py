"""Triton GPU kernels of the runtime, each beside a pure-torch reference of its contract.

All kernel entry points take CUDA tensors (or CPU tensors when Triton's interpreter is on:
``TRITON_INTERPRET=1`` before this package is imported). The references and
:func:`build_cos_sin_cache` run anywhere. KV pools are per layer ``[num_token_slots,
num_kv_heads, head_dim]``, addressed by token-level slot indices in CSR form
(``kv_indptr`` / ``kv_indices``).
"""

from kvflow.kernels.activation import silu_and_mul, silu_and_mul_ref
from kvflow.kernels.decode_attention import (
    MAX_KV_SPLITS,
    decode_attention_fwd,
    decode_attention_ref,
    decode_attention_table_fwd,
    decode_attention_table_ref,
    default_num_kv_splits,
)
from kvflow.kernels.extend_attention import extend_attention_fwd, extend_attention_ref
from kvflow.kernels.fused_moe import fused_moe, fused_moe_ref, moe_align_block_size
from kvflow.kernels.gemv import gemv, gemv_ref
from kvflow.kernels.kv_store import store_kv_cache, store_kv_cache_ref
from kvflow.kernels.lora import lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref
from kvflow.kernels.rmsnorm import rmsnorm, rmsnorm_ref
from kvflow.kernels.rope_cache import build_cos_sin_cache, rope_inv_freq
from kvflow.kernels.rotary import rotary_embedding, rotary_embedding_ref
from kvflow.kernels.sampling import top_k_top_p_sampling_from_probs, top_k_top_p_sampling_ref

__all__ = [
    "MAX_KV_SPLITS",
    "build_cos_sin_cache",
    "decode_attention_fwd",
    "decode_attention_ref",
    "decode_attention_table_fwd",
    "decode_attention_table_ref",
    "default_num_kv_splits",
    "extend_attention_fwd",
    "extend_attention_ref",
    "fused_moe",
    "fused_moe_ref",
    "gemv",
    "gemv_ref",
    "lora_expand",
    "lora_expand_ref",
    "lora_shrink",
    "lora_shrink_ref",
    "moe_align_block_size",
    "rmsnorm",
    "rmsnorm_ref",
    "rope_inv_freq",
    "rotary_embedding",
    "rotary_embedding_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "store_kv_cache",
    "store_kv_cache_ref",
    "top_k_top_p_sampling_from_probs",
    "top_k_top_p_sampling_ref",
]
