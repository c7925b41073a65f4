"""FP8 experts on a GPU: a tiny Qwen3-MoE checkpoint in the block, per-channel and per-tensor
formats (and a float one with ``--quantization fp8``) served by the engine (CUDA graphs on,
bfloat16) with the experts on the fused MoE kernel's FP8 path (W8A16) and the attention
and dense MLP on the FP8 GEMMs, against transformers on the dequantized weights with the
dense projections' inputs rounded as the FP8 GEMMs round them (the experts' inputs are
not: the kernel keeps them bf16). The comparison and its bounds are test_gpu_fp8.py's.

Skipped without CUDA; run on the accelerator machine with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).parent))
from family_parity import build_hf
from fp8_checkpoints import emulate_fp8_activations
from fp8_moe_checkpoints import write_fp8_moe
from test_gpu_fp8 import _compare

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
# every shard whole 128-row blocks and a multiple of 16 rows, so no layer is dequantized
QWEN3_MOE = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mlp_only_layers": [1],
    "intermediate_size": 512,
    "norm_topk_prob": True,
    "eos_token_id": 2,
}


@pytest.mark.parametrize(
    "fmt", ["hf-fp8-block", "ct-channel-dynamic", "ct-tensor-static", "online"]
)
def test_fp8_experts_on_cuda_follow_dequantized_transformers(tmp_path, fmt):
    build_hf(tmp_path / "float", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", **QWEN3_MOE)
    _sharpen_routers(tmp_path / "float")
    reference = write_fp8_moe(tmp_path / "float", tmp_path / "fp8", fmt, tmp_path / "reference")
    reference = emulate_fp8_activations(reference, tmp_path / "fp8", fmt)
    engine = {"quantization": "fp8"} if fmt == "online" else {}
    # a bounded pool: a failed case's engine lives on in its traceback
    _compare(tmp_path / "fp8", reference, expert_kernels=True, max_total_tokens=4096, **engine)


def _sharpen_routers(folder: Path, factor: float = 8.0) -> None:
    """Scale every router of the float checkpoint by ``factor``: random routers put
    near-ties among the top experts, where the W8A16 experts' rounding (not the method
    under test) flips a token's routing and its logprobs jump; both sides load the same
    sharpened weights."""
    from safetensors.torch import load_file, save_file

    for shard in folder.glob("*.safetensors"):
        tensors = load_file(shard)
        for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
            tensors[name] = tensors[name] * factor
        save_file(tensors, shard, metadata={"format": "pt"})
