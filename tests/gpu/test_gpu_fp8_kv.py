"""The FP8 KV cache on a GPU (``--kv-cache-dtype fp8_e4m3 | fp8_e5m2``): the Triton store,
decode and extend kernels inside the engine, CUDA graphs on, on a tiny Llama checkpoint with
its own ``k_scale`` / ``v_scale``, in float32, against transformers whose cache rounds every
key and value through FP8 with the same scales (tests/models/fp8_kv_reference.py), token
for token; and the triton backend against the torch backend on the same FP8 pool.

The kernels alone are checked in tests/kernels/test_fp8_kv_kernels.py (``gpu`` tests).
Skipped without CUDA; run on the accelerator machine with
``pytest -m gpu tests/gpu/test_gpu_fp8_kv.py tests/kernels/test_fp8_kv_kernels.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from family_parity import build_hf, prompts
from fp8_kv_reference import FP8, SCALES, add_kv_scales, greedy_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
# head_dim 128 as real models; 2 layers (SCALES has one pair per layer)
GPU_TINY = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 128}  # fmt: skip
GREEDY = {"temperature": 0, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8kv-gpu")
    hf = build_hf(folder, "LlamaForCausalLM", "LlamaConfig", **GPU_TINY)
    add_kv_scales(folder, SCALES)
    return folder, hf


def _greedy(folder: Path, **engine_kwargs) -> list[list[int]]:
    from kvflow.runtime.engine import Engine

    engine = Engine(
        str(folder),
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        max_running_requests=8,
        cuda_graph_max_bs=8,
        max_total_tokens=4096,  # two engines live in one test: neither takes the GPU's memory
        **engine_kwargs,
    )
    assert engine.runner.kv_pool.k_buffer[0].dtype == FP8[engine_kwargs["kv_cache_dtype"]]
    outputs = [r.output_ids for r in engine.generate(input_ids=prompts(), sampling_params=GREEDY)]
    assert engine.is_memory_free()
    return outputs


@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
def test_fp8_kv_cache_on_cuda_equals_transformers_with_an_fp8_rounded_cache(
    checkpoint, kv_cache_dtype
):
    folder, hf = checkpoint
    expected = greedy_fp8(hf, prompts(), FP8[kv_cache_dtype], SCALES)
    got = _greedy(folder, kv_cache_dtype=kv_cache_dtype)  # triton, CUDA graphs
    assert got == expected


@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
def test_triton_backend_equals_torch_backend_on_an_fp8_pool(checkpoint, kv_cache_dtype):
    folder, _ = checkpoint
    triton = _greedy(folder, kv_cache_dtype=kv_cache_dtype, chunked_prefill_size=16)
    torch_backend = _greedy(
        folder, kv_cache_dtype=kv_cache_dtype, chunked_prefill_size=16,
        attention_backend="torch", disable_cuda_graph=True,
    )  # fmt: skip
    assert triton == torch_backend


def test_bfloat16_model_over_an_fp8_cache_runs_graphs(checkpoint):
    """bfloat16 activations over FP8 KV (the serving configuration): graphs captured and
    replayed, memory returned; the tokens are not compared (bfloat16 rounding)."""
    from kvflow.runtime.engine import Engine

    folder, _ = checkpoint
    engine = Engine(
        str(folder), skip_tokenizer_init=True, device="cuda", dtype="bfloat16",
        kv_cache_dtype="fp8_e4m3", max_running_requests=8, cuda_graph_max_bs=8,
    )  # fmt: skip
    assert engine.runner.graph_runner is not None
    results = engine.generate(input_ids=prompts(), sampling_params=GREEDY)
    assert all(len(r.output_ids) > 0 for r in results)
    assert engine.is_memory_free()
