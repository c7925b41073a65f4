"""FP8 checkpoints in each published format (and a float checkpoint with ``--quantization
fp8``) against transformers running the dequantized weights, token for token, on CPU.

On CPU kvflow dequantizes the FP8 weights once at load and runs the float path, so its
greedy tokens must equal transformers' on the same dequantized weights exactly; CUDA's
FP8 arithmetic is checked in tests/gpu/test_gpu_fp8.py.
"""

from __future__ import annotations

import pytest
from family_parity import GREEDY, build_hf, engine_greedy, hf_greedy, prompts
from fp8_checkpoints import FORMATS, online_reference, write_fp8
from tp_ranks import run_ranks

QWEN3 = {"num_key_value_heads": 2, "head_dim": 32}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_llama_equals_dequantized_transformers(tmp_path, fmt):
    hf = build_hf(tmp_path / "float", "LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2)
    reference = write_fp8(hf, tmp_path / "float", tmp_path / "fp8", fmt)
    batch = prompts()
    assert engine_greedy(tmp_path / "fp8", batch) == hf_greedy(reference, batch)


def test_fp8_block_qwen3_equals_dequantized_transformers(tmp_path):
    """Qwen3's official FP8 format: 128x128 blocks over q (128 rows), k and v (64 each),
    and widths that end in part of a block (hidden 192, MLP 320)."""
    hf = build_hf(
        tmp_path / "float",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        **QWEN3,
        hidden_size=192,
        intermediate_size=320,
        eos_token_id=2,  # transformers stops there (hf_greedy); so must kvflow
    )
    reference = write_fp8(hf, tmp_path / "float", tmp_path / "fp8", "hf-fp8-block")
    batch = prompts()
    assert engine_greedy(tmp_path / "fp8", batch) == hf_greedy(reference, batch)


def test_quantization_fp8_on_float_checkpoint(tmp_path):
    """``--quantization fp8``: per-channel FP8 at load; the float model differs from it."""
    hf = build_hf(tmp_path, "LlamaForCausalLM", "LlamaConfig")
    batch = prompts()
    float_tokens = hf_greedy(hf, batch)
    expected = hf_greedy(online_reference(hf), batch)
    assert expected != float_tokens  # the rounding is visible, so the test can fail
    assert engine_greedy(tmp_path, batch, quantization="fp8") == expected


# tp 2: each rank holds whole 128-row blocks of every shard (q 256, k and v 128, MLP 256
# rows; o_proj's and down_proj's 256 input columns), as block checkpoints need
TP2_SHAPES = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_key_value_heads": 2,
    "head_dim": 128,
}


@pytest.mark.parametrize("fmt", ["hf-fp8-block", "ct-channel-dynamic", "modelopt"])
def test_fp8_tp2_equals_dequantized_transformers(tmp_path, fmt):
    """Scales split with their rows (per channel, per block: also by columns in the
    row-parallel layers) or stay whole (per tensor) on each of 2 ranks."""
    hf = build_hf(tmp_path / "float", "LlamaForCausalLM", "LlamaConfig", **TP2_SHAPES)
    reference = write_fp8(hf, tmp_path / "float", tmp_path / "fp8", fmt)
    batch = prompts()[:4]
    expected = hf_greedy(reference, batch)
    calls = [{"input_ids": batch, "sampling_params": GREEDY}]
    reports = run_ranks(2, str(tmp_path / "fp8"), calls, dtype="float32", skip_tokenizer_init=True)
    assert [r["outputs"] for r in reports] == [[expected]] * 2
