"""FP8 checkpoints on a GPU: a tiny model of each checkpoint format (and a float one with
``--quantization fp8``), served by the engine with the FP8 kernels (CUDA graphs on),
against transformers on the dequantized weights. The kernels and the FP8 linear method's
layers are checked on their own in tests/kernels/test_fp8_gemm.py and test_fp8_linear.py
(their ``gpu`` tests).

On CUDA the activations are quantized to FP8 too, so the reference rounds the inputs of
its quantized projections the same way (``emulate_fp8_activations``). Tokens still cannot
be compared one for one: kvflow runs in bfloat16, and a bfloat16 activation near an FP8
rounding boundary rounds to the other FP8 neighbour (3 mantissa bits: a 6% step), which
on this tiny random model (flat logits, top log-probability about -3.2) moves
log-probabilities by about 0.1. So the test compares, on the tokens kvflow generated,
kvflow's log-probability of each token with the reference's, and bounds the mean and the
largest difference. Measured with the same kernels under Triton's interpreter on CPU
(static per-tensor formats, whose activation rounding is torch's there): mean 0.10-0.12,
max 0.31-0.32, top-1 agreement 0.88; with the per-part weight scales of merged
projections swapped: mean 0.82, max 2.3, agreement 0.22.

Skipped without CUDA; run on the accelerator machine with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from family_parity import build_hf, prompts
from fp8_checkpoints import FORMATS, emulate_fp8_activations, online_reference, write_fp8

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


def _compare(
    folder: Path, reference: torch.nn.Module, expert_kernels: bool = False, **engine_kwargs
) -> None:
    """``expert_kernels``: the model has FP8 experts, which must run the fused kernel's FP8
    path too (test_gpu_fp8_moe.py)."""
    from kvflow.runtime.engine import Engine

    engine = Engine(
        str(folder),
        skip_tokenizer_init=True,
        device="cuda",
        dtype="bfloat16",
        max_running_requests=8,
        cuda_graph_max_bs=8,
        **engine_kwargs,
    )
    states = [
        m.__dict__["fp8_state"] for m in engine.runner.model.modules() if "fp8_state" in m.__dict__
    ]
    assert states and all(state is not None for state in states)  # FP8 kernels, no fallback
    if expert_kernels:
        modules = engine.runner.model.modules()
        scales = [
            m.__dict__["fp8_expert_scales"] for m in modules if "fp8_expert_scales" in m.__dict__
        ]
        assert scales and all(s is not None for s in scales)
    batch = prompts()
    greedy = {"temperature": 0, "max_new_tokens": MAX_NEW}
    results = engine.generate(input_ids=batch, sampling_params=greedy, return_logprob=True)
    reference = reference.cuda()
    diffs, agree = [], 0
    for ids, result in zip(batch, results, strict=True):
        with torch.no_grad():
            logits = reference(torch.tensor([ids + result.output_ids], device="cuda")).logits
        logprobs = torch.log_softmax(logits[0].float(), dim=-1)
        for step, token in enumerate(result.output_ids):
            row = logprobs[len(ids) - 1 + step]
            diffs.append(abs(row[token].item() - result.logprobs[step]))
            agree += int(row.argmax().item() == token)
    diff = torch.tensor(diffs)
    assert diff.mean() < 0.3 and diff.max() < 1.2, (diff.mean(), diff.max())
    assert agree / len(diffs) >= 0.6, agree / len(diffs)
    assert engine.is_memory_free()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_fp8_checkpoint_on_cuda_follows_dequantized_transformers(tmp_path, fmt):
    hf = build_hf(tmp_path / "float", "LlamaForCausalLM", "LlamaConfig", **GPU_TINY)
    reference = write_fp8(hf, tmp_path / "float", tmp_path / "fp8", fmt)
    _compare(tmp_path / "fp8", emulate_fp8_activations(reference, tmp_path / "fp8", fmt))


def test_quantization_fp8_on_cuda_follows_rounded_transformers(tmp_path):
    hf = build_hf(tmp_path, "LlamaForCausalLM", "LlamaConfig", **GPU_TINY)
    reference = emulate_fp8_activations(online_reference(hf), tmp_path, "online")
    _compare(tmp_path, reference, quantization="fp8")
