"""FP8 experts: Qwen3-MoE and Mixtral checkpoints in each published FP8 format (and a float
checkpoint with ``--quantization fp8``) against transformers running the dequantized
weights, greedy token for token over a batch, on CPU (where kvflow dequantizes at load:
the fused kernel's FP8 path is checked in tests/kernels/test_fused_moe.py); a malformed
expert scale is a load error; at tp 2 each rank keeps its rows (gate, up) or columns
(down) of every expert's weights and scales."""

from __future__ import annotations

import pytest
import torch
from family_parity import GREEDY, build_hf, engine_greedy, hf_greedy, prompts
from fp8_checkpoints import FORMATS
from fp8_moe_checkpoints import write_fp8_moe
from safetensors.torch import load_file, save_file
from tp_ranks import run_ranks

from kvflow.runtime.config import ModelConfig
from kvflow.runtime.models.loader import load_model

MOE = {"num_experts_per_tok": 2, "num_key_value_heads": 2, "eos_token_id": 2}
# hidden 192 and expert width 160: 128x128 blocks that end inside a block (gate and up
# rows, down columns); layer 1 dense, so a dense FP8 MLP beside FP8 experts
QWEN3_MOE = {**MOE, "num_experts": 4, "moe_intermediate_size": 160, "head_dim": 32,
             "hidden_size": 192, "mlp_only_layers": [1], "norm_topk_prob": True}  # fmt: skip
MIXTRAL = {**MOE, "num_local_experts": 4}
FAMILIES = {
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_MOE),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", MIXTRAL),
}


def _checkpoint(tmp_path, family: str, fmt: str, **shapes) -> torch.nn.Module:
    model_cls, config_cls, config = FAMILIES[family]
    build_hf(tmp_path / "float", model_cls, config_cls, **{**config, **shapes})
    return write_fp8_moe(tmp_path / "float", tmp_path / "fp8", fmt, tmp_path / "reference")


@pytest.mark.parametrize("fmt", [*FORMATS, "online"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_experts_equal_dequantized_transformers(tmp_path, family, fmt):
    reference = _checkpoint(tmp_path, family, fmt)
    batch = prompts()
    engine = {"quantization": "fp8"} if fmt == "online" else {}
    assert engine_greedy(tmp_path / "fp8", batch, **engine) == hf_greedy(reference, batch)


def test_quantization_fp8_rounds_the_experts(tmp_path):
    """--quantization fp8 on a float MoE: the rounding changes the tokens (so the test above
    can fail); the experts take the FP8 method, the router stays float."""
    reference = _checkpoint(tmp_path, "qwen3-moe", "online")
    batch = prompts()
    expected = hf_greedy(reference, batch)
    assert engine_greedy(tmp_path / "fp8", batch) != expected  # float
    model = load_model(
        tmp_path / "fp8", ModelConfig.from_path(tmp_path / "fp8"), "safetensors",
        torch.float32, "cpu", 0, quantization="fp8",
    )  # fmt: skip
    experts = model.layers[0].mlp.experts
    assert type(experts.method).__name__ == "Fp8MoEMethod"
    assert type(model.layers[0].mlp.gate.method).__name__ == "UnquantizedLinearMethod"


def test_malformed_expert_scale_is_a_load_error(tmp_path):
    _checkpoint(tmp_path, "qwen3-moe", "hf-fp8-block")
    file = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"
    assert tensors[name].shape == (2, 2)  # 160 rows, 192 columns in 128x128 blocks
    tensors[name] = tensors[name][:1]
    save_file(tensors, str(file))
    config = ModelConfig.from_path(tmp_path / "fp8")
    with pytest.raises(
        ValueError, match=r"expert 1 part 1: checkpoint shape \(1, 2\), expected \(2, 2\)"
    ):
        load_model(tmp_path / "fp8", config, "safetensors", torch.float32, "cpu", 0)


# tp 2: each rank holds 128 of every expert's 256 gate and up rows and down columns, whole
# 128x128 blocks; attention as in test_fp8_checkpoints' TP2_SHAPES
TP2 = {"hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 128, "mlp_only_layers": []}


@pytest.mark.parametrize("fmt", ["hf-fp8-block", "ct-channel-dynamic", "ct-tensor-static"])
def test_fp8_experts_tp2_equal_dequantized_transformers(tmp_path, fmt):
    reference = _checkpoint(tmp_path, "qwen3-moe", fmt, **TP2)
    batch = prompts()[:4]
    expected = hf_greedy(reference, batch)
    calls = [{"input_ids": batch, "sampling_params": GREEDY}]
    reports = run_ranks(2, str(tmp_path / "fp8"), calls, dtype="float32", skip_tokenizer_init=True)
    assert [r["outputs"] for r in reports] == [[expected]] * 2


def _ignoring(monkeypatch, pattern: str) -> str:
    """A compressed-tensors per-channel format that leaves ``pattern``'s modules float."""
    config, *rest = FORMATS["ct-channel-dynamic"]
    monkeypatch.setitem(FORMATS, "ct-ignore", ({**config, "ignore": ["lm_head", pattern]}, *rest))
    return "ct-ignore"


def test_experts_a_checkpoint_leaves_float(tmp_path, monkeypatch):
    """All of layer 0's experts ignored: they load float beside FP8 attention."""
    fmt = _ignoring(monkeypatch, r"re:.*layers\.0\.mlp\.experts\..*")
    reference = _checkpoint(tmp_path, "qwen3-moe", fmt)
    batch = prompts()[:4]
    assert engine_greedy(tmp_path / "fp8", batch) == hf_greedy(reference, batch)


def test_some_experts_left_float_is_refused(tmp_path, monkeypatch):
    fmt = _ignoring(monkeypatch, r"re:.*layers\.0\.mlp\.experts\.1\..*")
    _checkpoint(tmp_path, "qwen3-moe", fmt)
    config = ModelConfig.from_path(tmp_path / "fp8")
    with pytest.raises(ValueError, match="quantizes some of its parts and not others"):
        load_model(tmp_path / "fp8", config, "safetensors", torch.float32, "cpu", 0)
