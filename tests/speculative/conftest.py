"""Tiny random-weight Llama configs for speculative decoding's tests (a target and drafts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "eos_token_id": 95,
}


def write_config(folder: Path, **overrides) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY, **overrides}))
    return str(folder / "config.json")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """``target``: the tiny config; ``shallow``: the same shapes with one layer (other random
    weights: a draft that is often wrong)."""
    root = tmp_path_factory.mktemp("spec-models")
    return {
        "target": write_config(root / "target"),
        "shallow": write_config(root / "shallow", num_hidden_layers=1),
    }


@pytest.fixture
def tiny_engine():
    """Build engines on a tiny config with random weights (``load_format="dummy"``)."""
    from kvflow.runtime.engine import Engine

    def build(path: str, **kwargs):
        # float32: in bfloat16 a verify (extend) row and a decode row of the same position
        # may round to another argmax, and these tests compare token for token
        settings = dict(
            load_format="dummy",
            skip_tokenizer_init=True,
            device="cpu",
            dtype="float32",
            max_total_tokens=2048,
        )
        return Engine(path, **{**settings, **kwargs})

    return build
