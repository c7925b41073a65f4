"""The shipped dummy configs (random weights in real shapes, for GPU runs) describe the
models they are named after: each passes the start-up check, and the model built from it
on the meta device has the published parameter count."""

from __future__ import annotations

import pytest
import torch

from kvflow.runtime.config import DUMMY_CONFIGS, ModelConfig
from kvflow.runtime.models import MODELS, check_supported

# Published sizes (model cards), in billions of parameters, embeddings included.
PUBLISHED_B = {
    "llama-3.1-8b": 8.03,
    "llama-3.1-70b": 70.6,
    "qwen3-8b": 8.19,
    "mistral-7b-v0.3": 7.25,
    "qwen3-30b-a3b": 30.5,
    "gemma-2-9b": 9.24,
    # Gemma 3 12B is 12.19B with its 0.42B SigLIP vision tower; the config is its decoder
    "gemma-3-12b": 11.77,
}


@pytest.mark.parametrize("name", sorted(DUMMY_CONFIGS))
def test_dummy_config_has_the_published_size(name: str) -> None:
    config = ModelConfig.from_path(DUMMY_CONFIGS[name])
    check_supported(config)
    with torch.device("meta"):
        model = MODELS.get(config.architecture)(config)
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    assert billions == pytest.approx(PUBLISHED_B[name], rel=0.01), billions


def test_every_dummy_config_is_listed_here() -> None:
    assert set(DUMMY_CONFIGS) <= set(PUBLISHED_B)
