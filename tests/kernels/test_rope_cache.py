"""build_cos_sin_cache against transformers' own RoPE (CPU): bit-equal in fp32."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvflow.kernels import build_cos_sin_cache, rope_inv_freq

LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _config(head_dim: int, theta: float, scaling: dict | None, max_pos: int) -> LlamaConfig:
    rope_parameters = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=rope_parameters,
    )


CASES = [
    (64, 10000.0, None),  # SmolLM2 / Llama 2 style default RoPE
    (128, 500000.0, LLAMA31_SCALING),  # Llama 3.1 8B
    (64, 500000.0, {**LLAMA31_SCALING, "factor": 32.0, "high_freq_factor": 2.0}),
    (128, 10000.0, {"rope_type": "linear", "factor": 4.0}),
]


@pytest.mark.parametrize(("head_dim", "theta", "scaling"), CASES)
def test_cos_sin_cache_matches_llama_rotary_embedding(head_dim, theta, scaling):
    max_pos = 16384
    rotary = LlamaRotaryEmbedding(_config(head_dim, theta, scaling, max_pos))
    positions = torch.tensor([[0, 1, 2, 17, 1000, 8191, 8192, 12345, max_pos - 1]])
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [1, n, d]
    cache = build_cos_sin_cache(head_dim, max_pos, theta, scaling)
    cos, sin = cache[positions[0]].chunk(2, dim=-1)
    half = head_dim // 2
    assert cache.shape == (max_pos, head_dim) and cache.dtype == torch.float32
    assert torch.equal(cos, hf_cos[0, :, :half]) and torch.equal(cos, hf_cos[0, :, half:])
    assert torch.equal(sin, hf_sin[0, :, :half]) and torch.equal(sin, hf_sin[0, :, half:])


@pytest.mark.parametrize(("head_dim", "theta", "scaling"), CASES[1:])
def test_inv_freq_matches_rope_init_functions(head_dim, theta, scaling):
    config = _config(head_dim, theta, scaling, 131072)
    hf_inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    assert attention_factor == 1.0
    assert torch.equal(rope_inv_freq(head_dim, theta, scaling), hf_inv_freq)


def test_llama3_scaling_changes_low_frequencies_only():
    default = rope_inv_freq(128, 500000.0, None)
    scaled = rope_inv_freq(128, 500000.0, LLAMA31_SCALING)
    assert torch.equal(scaled[:8], default[:8])  # wavelengths below 2048: untouched
    torch.testing.assert_close(scaled[-4:], default[-4:] / 8.0)  # beyond 8192: divided


def test_legacy_type_key_and_unknown_type():
    legacy = {**LLAMA31_SCALING, "type": "llama3"}
    del legacy["rope_type"]
    assert torch.equal(rope_inv_freq(128, 5e5, legacy), rope_inv_freq(128, 5e5, LLAMA31_SCALING))
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(128, 5e5, {"rope_type": "yarn", "factor": 2.0})


def test_cache_dtype():
    assert build_cos_sin_cache(64, 8, 10000.0, dtype=torch.bfloat16).dtype == torch.bfloat16
