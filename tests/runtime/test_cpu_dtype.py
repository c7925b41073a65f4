"""The CPU's ``auto`` dtype: bfloat16 where the CPU has native bf16, else float32; the
bfloat16 default keeps transformers' float32 greedy output on the parity prompts, except
where it is documented to part (docs/runtime.md, "Running on CPU")."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvflow.kernels import cpu
from kvflow.kernels.cpu.features import native_bf16
from kvflow.runtime import model_runner
from kvflow.runtime.config import EngineConfig, ModelConfig

MAX_NEW = 24  # as many as the reference (tests/runtime/conftest.py, PARITY_MAX_NEW)
# prompt index -> tokens equal before the bfloat16 default takes another greedy path
# (3: "List three primary colors ...": transformers' float32 top two 0.008 apart there).
# With the matmuls on AMX tiles, whose sums round in another order than the AVX512 tiles',
# 2 ("Hi") parts too, where the top two are 0.038 apart.
BF16_PARTS_AT = {3: 10}
BF16_PARTS_AT_WITH_AMX = {2: 12, 3: 10}


@pytest.mark.parametrize(
    ("flags", "native"),
    [({"avx512f", "avx512_bf16"}, True), ({"amx_tile", "amx_bf16"}, True), ({"avx512f"}, False)],
)
def test_native_bf16_reads_the_cpu_flags(flags, native):
    assert native_bf16(frozenset(flags)) is native


def _checkpoint(model_path, torch_dtype: str) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_path(model_path), torch_dtype=torch_dtype)


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch, model_path, native):
    monkeypatch.setattr(cpu, "native_bf16", lambda: native)
    config = EngineConfig(device="cpu")
    picked = model_runner._pick_dtype(config, _checkpoint(model_path, "float32"))
    assert picked == (torch.bfloat16 if native else torch.float32)
    explicit = dataclasses.replace(config, dtype="float32")
    assert model_runner._pick_dtype(explicit, _checkpoint(model_path, "float32")) == torch.float32


def test_auto_dtype_on_cuda_is_unchanged(monkeypatch, model_path):
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)
    config = EngineConfig(device="cuda")
    pick = model_runner._pick_dtype
    assert pick(config, _checkpoint(model_path, "float32")) == torch.bfloat16
    assert pick(config, _checkpoint(model_path, "float16")) == torch.float16


@pytest.mark.skipif(not native_bf16(), reason="the CPU has no native bfloat16")
def test_bf16_default_keeps_transformers_greedy_output(model_path, prompts, hf_greedy):
    """The parity prompts (tests/runtime/conftest.py): ``hf_greedy`` is set up before the
    engine, whose kernel threads would contend with transformers' OpenMP ones."""
    from kvflow.runtime.engine import Engine

    engine = Engine(str(model_path), max_total_tokens=4096)
    assert engine.runner.dtype == torch.bfloat16
    # the packed panels serve every row of the projections: their float copies are freed
    # (release_float_weights), so these tokens come from the panels alone
    packed = [m for m in engine.runner.model.modules() if m.__dict__.get("packed_weight")]
    assert packed and all(m.weight.numel() == 0 for m in packed)
    results = engine.generate(
        input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW}
    )
    parts_at = BF16_PARTS_AT_WITH_AMX if cpu.gemm.use_amx() else BF16_PARTS_AT
    for index, (want, result) in enumerate(zip(hf_greedy, results, strict=True)):
        equal = parts_at.get(index, len(want))
        assert result.output_ids[:equal] == want[:equal], f"prompt {index}"
        if index in parts_at:  # it no longer parts there: update the table and the docs
            assert result.output_ids != want, f"prompt {index}"
    assert engine.is_memory_free()
