"""The dense families on a GPU against transformers: tiny random configs in float32 (CUDA
graphs on, greedy tokens equal; Qwen2 with YaRN RoPE among them; ``is_embedding`` pooling
within cosine 0.999), and each shipped dummy config's real layer shapes (four
layers) in bfloat16, whose last-position logits must be as close to a float32 reference
as transformers' own bfloat16 forward is.

Skipped without CUDA; run on the accelerator machine with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from family_parity import build_hf, engine_greedy, hf_greedy, prompts
from prefill_logits import (
    assert_as_close_as_transformers,
    bf16_runner,
    last_logits,
    transformers_logits,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"num_key_value_heads": 2}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"num_key_value_heads": 2, "head_dim": 32}),
    # a window shorter than the longer prompts plus their outputs
    "mistral": (
        "MistralForCausalLM",
        "MistralConfig",
        {"num_key_value_heads": 2, "sliding_window": 24},
    ),
    # Qwen2.5's long-context recipe: positions reach 88, past the 32 of pretraining
    "qwen2-yarn": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        {
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
        },
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_on_cuda_equals_transformers(tmp_path, family):
    model_cls, config_cls, config = FAMILIES[family]
    hf = build_hf(tmp_path, model_cls, config_cls, eos_token_id=2, **config)
    batch = prompts()
    expected = hf_greedy(hf, batch)
    got = engine_greedy(tmp_path, batch, device="cuda", max_running_requests=8, cuda_graph_max_bs=8)
    assert got == expected


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_on_cuda_equal_transformers(tmp_path, pooling):
    """``is_embedding`` on CUDA: pooled, normalised final-norm states against transformers'
    (float32, chunked prefill so a prompt's pooling spans several steps)."""
    from test_embeddings import check_close, mark_mean_pooling

    from kvflow.runtime.engine import Engine

    hf = build_hf(tmp_path, "Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2)
    if pooling == "mean":
        mark_mean_pooling(tmp_path)
    engine = Engine(
        str(tmp_path),
        is_embedding=True,
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        chunked_prefill_size=16,
    )
    check_close(engine, hf, prompts(), pooling)


REAL_SHAPES = ("qwen3-8b", "mistral-7b-v0.3", "qwen3-30b-a3b")
LAYERS = 4
PROMPT = 48


@pytest.mark.parametrize("name", REAL_SHAPES)
def test_real_shapes_logits_close_in_bf16(tmp_path, name):
    """Four layers of the real shapes, random weights: kvflow's bf16 logits are as close to
    transformers' float32 logits as transformers' own bf16 logits are."""
    import transformers

    from kvflow.runtime.config import DUMMY_CONFIGS

    raw = json.loads(DUMMY_CONFIGS[name].read_text()) | {"num_hidden_layers": LAYERS}
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (PROMPT,), device="cuda")
    with torch.device("cuda"):
        hf = getattr(transformers, raw["architectures"][0])(config).to(torch.float32).eval()
    for _, param in hf.named_parameters():
        if param.dim() > 1:
            param.data.normal_(0, 0.02)
    reference, hf_bf16 = transformers_logits(hf, ids)
    hf.save_pretrained(tmp_path)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    runner = bf16_runner(str(tmp_path))
    assert_as_close_as_transformers(name, last_logits(runner, ids), hf_bf16, reference)
