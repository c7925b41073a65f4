"""check_supported refuses, before any process starts, what the runtime cannot serve:
unknown architectures and unsupported RoPE types. Sliding windows are served: the config
says which layers slide."""

from __future__ import annotations

import pytest

from kvflow.runtime.config import ModelConfig
from kvflow.runtime.models import EAGLE_HEADS, MODELS, ROPE_TYPES, check_supported

HEADS = [arch for archs in EAGLE_HEADS.values() for arch in archs]
SERVED = [arch for arch in MODELS.choices() if arch not in HEADS]

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 515,
    "max_position_embeddings": 32768,
}


def _config(**raw: object) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **raw})


@pytest.mark.parametrize("arch", SERVED)
def test_registered_architectures_pass(arch):
    check_supported(_config(architectures=[arch]))


@pytest.mark.parametrize("arch", HEADS)
def test_draft_heads_are_not_served(arch):
    with pytest.raises(ValueError, match="is an EAGLE draft head, not a model to serve"):
        check_supported(_config(architectures=[arch]))


def test_unknown_architecture_names_it_and_the_supported_ones():
    with pytest.raises(ValueError) as err:
        check_supported(_config(architectures=["GemmaForCausalLM"]))
    message = str(err.value)
    assert "\n" not in message
    assert "'GemmaForCausalLM'" in message
    assert all(arch in message for arch in SERVED)


@pytest.mark.parametrize("rope_type", ["longrope", "dynamic"])
def test_unsupported_rope_type_is_refused(rope_type):
    config = _config(rope_scaling={"rope_type": rope_type, "factor": 2.0})
    with pytest.raises(ValueError, match=f"rope_type '{rope_type}'.*supported: default"):
        check_supported(config)


def test_legacy_rope_type_key_is_read():
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        check_supported(_config(rope_scaling={"type": "dynamic", "factor": 2.0}))
    check_supported(_config(rope_scaling={"type": "linear", "factor": 2.0}))


def test_every_supported_rope_type_builds():
    """ROPE_TYPES and the rotary layer stay in step."""
    from kvflow.runtime.layers import RotaryEmbedding

    extra = {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    for rope_type in ROPE_TYPES:
        config = _config(max_position_embeddings=64, rope_scaling={"rope_type": rope_type, **extra})
        check_supported(config)
        RotaryEmbedding(16, 64, config.rope_theta, config.rope_scaling)


def test_mistral_v01_window_is_served_on_every_layer():
    """Mistral-7B-v0.1: a 4096-token window over 32768 positions, every layer."""
    config = _config(architectures=["MistralForCausalLM"], sliding_window=4096)
    assert config.sliding_window == 4096
    assert [config.layer_window(i) for i in range(2)] == [4096, 4096]
    check_supported(config)
    check_supported(config, context_length=8192)


@pytest.mark.parametrize(
    "raw",
    [
        {"sliding_window": None},  # Mistral v0.2+
        {"sliding_window": 32768},  # as long as the context
        {"sliding_window": 65536},
    ],
)
def test_mistral_without_a_shorter_window_passes(raw):
    config = _config(architectures=["MistralForCausalLM"], **raw)
    check_supported(config)
    if raw["sliding_window"] is None:
        assert config.sliding_layers == () and config.layer_window(0) is None


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_windows_count_only_when_used(arch):
    """Qwen2/Qwen3 configs carry sliding_window with use_sliding_window false; when used, the
    layers from max_window_layers on slide (transformers' rule), the others attend fully."""
    unused = _config(architectures=[arch], sliding_window=4096, use_sliding_window=False)
    assert unused.sliding_window is None
    check_supported(unused)
    # max_window_layers: the layers below it keep full attention
    above = {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 2}
    assert _config(architectures=[arch], **above).sliding_window is None
    used = _config(architectures=[arch], **{**above, "max_window_layers": 1})
    assert used.sliding_window == 4096
    assert [used.layer_window(i) for i in range(2)] == [None, 4096]
    check_supported(used)
    # transformers >= 5 saves layer_types
    typed = {"sliding_window": 4096, "layer_types": ["full_attention"] * 2}
    assert _config(architectures=[arch], **typed).sliding_window is None
    mixed = {"sliding_window": 4096, "layer_types": ["sliding_attention", "full_attention"]}
    assert _config(architectures=[arch], **mixed).sliding_layers == (0,)


def test_yarn_context_is_original_times_factor():
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    config = _config(architectures=["Qwen2ForCausalLM"], rope_scaling=rope)
    assert config.max_position_embeddings == 131072
    check_supported(config, context_length=131072)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"architectures": ["FooForCausalLM"]}, "model architecture 'FooForCausalLM'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type 'longrope'"),
    ],
)
def test_serve_refuses_before_start(tmp_path, raw, message):
    """``kvflow serve`` on such a checkpoint: one line, exit 2, no process started."""
    import json
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps({**BASE, **raw}))
    flags = ["--model-path", str(tmp_path), "--load-format", "dummy", "--skip-tokenizer-init"]
    done = subprocess.run(
        [sys.executable, "-P", "-m", "kvflow", "serve", *flags, "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr
    assert "Traceback" not in done.stderr
