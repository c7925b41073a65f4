"""FP8 checkpoints on a GPU: a tiny model of each checkpoint format, served by the engine
with the FP8 kernels (CUDA graphs on), against transformers on the dequantized weights.
The kernels and the FP8 linear method's layers are checked on their own in
tests/kernels/test_fp8_gemm.py and test_fp8_linear.py (their ``gpu`` tests).

On CUDA the activations are quantized to FP8 too (transformers' reference keeps them in
float), so outputs differ by FP8's rounding of the activations (3 mantissa bits, about
2^-4 relative per element): the test asks that every greedy token kvflow picks is transformers' top-1 or within a small logit
margin of it (a near-tie the rounding may flip), and that most are its top-1. The CPU
tests (tests/models/test_fp8_checkpoints.py) check the formats token for token.

Skipped without CUDA; run on the accelerator machine with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from family_parity import build_hf, prompts
from fp8_checkpoints import FORMATS, write_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
MAX_NEW = 16
# a GPU-sized tiny model: every shard a whole number of 128-row blocks and of 16 rows, so
# each layer runs an FP8 kernel (a layer the kernels do not take would be dequantized)
GPU_TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "eos_token_id": 2,
}


def _teacher_forced_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids], device="cuda")).logits[0].float()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_fp8_checkpoint_on_cuda_follows_dequantized_transformers(tmp_path, fmt):
    from kvflow.runtime.engine import Engine

    hf = build_hf(tmp_path / "float", "LlamaForCausalLM", "LlamaConfig", **GPU_TINY)
    reference = write_fp8(hf, tmp_path / "float", tmp_path / "fp8", fmt).cuda()
    engine = Engine(
        str(tmp_path / "fp8"),
        skip_tokenizer_init=True,
        device="cuda",
        dtype="bfloat16",
        max_running_requests=8,
        cuda_graph_max_bs=8,
    )
    states = [
        m.__dict__["fp8_state"] for m in engine.runner.model.modules() if "fp8_state" in m.__dict__
    ]
    assert states and all(state is not None for state in states)  # FP8 kernels, no fallback
    batch = prompts()
    results = engine.generate(
        input_ids=batch, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW}
    )
    agree = total = 0
    for ids, result in zip(batch, results, strict=True):
        logits = _teacher_forced_logits(reference, ids + result.output_ids)
        for step, token in enumerate(result.output_ids):
            row = logits[len(ids) - 1 + step]
            total += 1
            agree += int(row.argmax() == token)
            # a token kvflow picks is transformers' top-1 or a near-tie with it
            assert row.max() - row[token] < 0.5, (fmt, step, row.max() - row[token])
    assert agree / total >= 0.9, agree / total
    assert engine.is_memory_free()
