"""KV pools in the embedded model's shape, built without loading the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.runtime.config import ModelConfig

if TYPE_CHECKING:  # torch is imported lazily: kv_peer.py --bare runs without it
    import torch

    from kvflow.runtime.mem import KVPool

# SmolLM2-135M's config.json fields that shape the KV cache.
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}


def model_config(**overrides: object) -> ModelConfig:
    return ModelConfig.from_dict({**SMOLLM2, **overrides})


def kv_pool(config: ModelConfig, num_slots: int, dtype: torch.dtype | None = None) -> KVPool:
    import torch

    from kvflow.runtime.mem import KVPool

    return KVPool(
        num_slots,
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        dtype or torch.float32,
        "cpu",
    )
