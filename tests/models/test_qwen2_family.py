"""Qwen2 / Qwen2.5 against transformers: QKV bias, tied and untied heads, YaRN RoPE."""

from __future__ import annotations

import pytest
import torch
from family_parity import build_hf, engine_greedy, hf_greedy, prompts

from kvflow.runtime.config import ModelConfig

# positions reach 64 + 24 = 88, past the 32 of pretraining
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen2_equals_transformers(tmp_path, tied):
    hf = build_hf(
        tmp_path,
        "Qwen2ForCausalLM",
        "Qwen2Config",
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    batch = prompts()
    assert engine_greedy(tmp_path, batch) == hf_greedy(hf, batch)


def test_qwen2_yarn_equals_transformers(tmp_path):
    hf = build_hf(
        tmp_path,
        "Qwen2ForCausalLM",
        "Qwen2Config",
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_parameters={**YARN, "rope_theta": 10000.0},
    )
    assert ModelConfig.from_path(tmp_path).rope_type == "yarn"
    batch = prompts()
    assert engine_greedy(tmp_path, batch) == hf_greedy(hf, batch)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"beta_fast": 16, "beta_slow": 2, "attention_factor": 1.3},
        {"mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
        {"factor": 1.0},
    ],
    ids=["defaults", "betas-attention-factor", "mscale-untruncated", "factor-1"],
)
def test_yarn_table_equals_transformers(extra):
    """cos and sin, attention factor included, bit for bit over every position."""
    import transformers
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from kvflow.runtime.layers import RotaryEmbedding

    scaling = {**YARN, **extra}
    config = transformers.Qwen2Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=128,
        rope_parameters={**scaling, "rope_theta": 10000.0},
    )
    cos, sin = Qwen2RotaryEmbedding(config)(torch.zeros(1), torch.arange(128)[None])
    table = RotaryEmbedding(16, 128, 10000.0, scaling).cos_sin_cache
    assert torch.equal(table[:, :8], cos[0, :, :8])
    assert torch.equal(table[:, 8:], sin[0, :, :8])


def test_yarn_config_of_qwen25_recipe():
    """Qwen2.5's README adds YaRN in the legacy ``rope_scaling`` form to a config whose
    max_position_embeddings stays 32768: kvflow serves original x factor."""
    raw = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 515,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
        "sliding_window": 131072,
        "use_sliding_window": False,
    }
    config = ModelConfig.from_dict(raw)
    assert config.rope_type == "yarn"
    assert config.max_position_embeddings == 131072
    assert config.sliding_window is None
    assert config.attention_bias
    # without original_max_position_embeddings, transformers takes max_position_embeddings
    del raw["rope_scaling"]["original_max_position_embeddings"]
    config = ModelConfig.from_dict(raw)
    assert config.rope_scaling is not None
    assert config.rope_scaling["original_max_position_embeddings"] == 32768


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_qwen2_window_on_upper_layers_equals_transformers(tmp_path, backend):
    """use_sliding_window with max_window_layers 1: layer 0 attends fully, layer 1 slides a
    16-token window (per-layer windows), with chunked prefill shorter than the window."""
    from kvflow.kernels import cpu as cpu_kernels

    if backend == "cpu" and not cpu_kernels.available():
        pytest.skip("no C compiler")
    hf = build_hf(
        tmp_path,
        "Qwen2ForCausalLM",
        "Qwen2Config",
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
        eos_token_id=2,  # hf_greedy stops at 2; Qwen2Config has no eos by default
    )
    config = ModelConfig.from_path(tmp_path)
    assert [config.layer_window(i) for i in range(2)] == [None, 16]
    batch = prompts()
    engine = {"attention_backend": backend, "chunked_prefill_size": 12}
    assert engine_greedy(tmp_path, batch, **engine) == hf_greedy(hf, batch)
