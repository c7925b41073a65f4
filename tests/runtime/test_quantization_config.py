"""Weight formats from config.json and --quantization: each published FP8 format parses
into its typed config, and what kvflow cannot serve is refused at argument parsing with
one line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvflow.runtime.layers.quantization import Fp8Scheme, resolve_quantization
from kvflow.runtime.server.args import parse_args

QWEN3_FP8 = {  # Qwen/Qwen3-8B-FP8's config.json, as published
    "activation_scheme": "dynamic",
    "modules_to_not_convert": None,
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
CT_FP8_DYNAMIC = {  # llm-compressor FP8_DYNAMIC (RedHatAI/...-FP8-dynamic)
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "ignore": ["lm_head", "re:.*mlp.gate$"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
}

CT_INT8 = {  # a W8A16 integer checkpoint: not FP8
    **CT_FP8_DYNAMIC,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
            "input_activations": None,
        }
    },
}


def test_qwen3_fp8_is_block_scaled() -> None:
    quant = resolve_quantization(QWEN3_FP8, None)
    assert quant is not None
    assert quant.scheme == Fp8Scheme("block", False, (128, 128), "weight_scale_inv")


def test_compressed_tensors_channel_dynamic_and_ignore() -> None:
    quant = resolve_quantization(CT_FP8_DYNAMIC, "fp8")
    assert quant is not None and quant.scheme == Fp8Scheme("channel")
    assert quant.ignores("lm_head") and quant.ignores("model.layers.3.mlp.gate")
    assert not quant.ignores("model.layers.3.mlp.gate_proj")


def test_modelopt_exclude_patterns() -> None:
    quant = resolve_quantization(
        {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8",
         "exclude_modules": ["lm_head", "model.layers.0.*"]}},
        None,
    )  # fmt: skip
    assert quant is not None and quant.scheme == Fp8Scheme("tensor", static_input=True)
    assert quant.ignores("model.layers.0.mlp.up_proj")
    assert not quant.ignores("model.layers.10.mlp.up_proj")


def test_float_checkpoint() -> None:
    assert resolve_quantization(None, None) is None
    online = resolve_quantization(None, "fp8")
    assert online is not None and not online.scheme.serialized


def _folder(tmp_path: Path, quant: dict[str, Any] | None, **extra: Any) -> str:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        **extra,
    }
    if quant is not None:
        raw["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    return err


@pytest.mark.parametrize(
    ("quant", "flag", "message"),
    [
        ({"quant_method": "awq", "bits": 4}, None, "quant_method 'awq' is not supported"),
        ({**QWEN3_FP8, "fmt": "e5m2"}, None, "e4m3 weights only"),
        ({**QWEN3_FP8, "activation_scheme": "static"}, None, "dynamic activations"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, None, "'NVFP4' is not served"),
        (CT_INT8, None, "8-bit float weights"),
        (CT_FP8_DYNAMIC, "modelopt", "contradicts the checkpoint's quant_method"),
        (None, "compressed-tensors", "the checkpoint is not quantized"),
    ],
    ids=["awq", "e5m2", "block-static", "nvfp4", "ct-int8", "contradicts", "not-quantized"],
)
def test_unservable_formats_are_refused_at_parsing(tmp_path, capsys, quant, flag, message):
    argv = ["--model-path", _folder(tmp_path, quant)]
    err = _refused(argv + (["--quantization", flag] if flag else []), capsys)
    assert message in err and err.startswith("kvflow serve: error:")


def test_other_sglang_quantization_values_are_refused(tmp_path, capsys):
    err = _refused(["--model-path", _folder(tmp_path, None), "--quantization", "awq"], capsys)
    assert "'awq': kvflow serves FP8 weights (" in err


def test_fp8_moe_parses_and_gguf_moe_is_refused(tmp_path):
    """FP8 experts are served (checkpoint or --quantization fp8); GGUF experts are not."""
    folder = _folder(tmp_path, QWEN3_FP8, num_experts=4, num_experts_per_tok=2)
    assert parse_args(["--model-path", folder]).engine.quantization is None
    assert resolve_quantization(None, "fp8", is_moe=True) is not None
    with pytest.raises(ValueError, match="experts are not served from GGUF blocks"):
        resolve_quantization(None, "gguf", is_moe=True, gguf_file="model.gguf")


def test_quantization_fp8_on_a_float_checkpoint_parses(tmp_path):
    args = parse_args(["--model-path", _folder(tmp_path, None), "--quantization", "fp8"])
    assert args.engine.quantization == "fp8"
    assert parse_args(["--model-path", _folder(tmp_path, QWEN3_FP8)]).engine.quantization is None
