"""CPU decode graphs (kvflow.runtime.cpu_graph): every decode step of an engine runs both the
one-call native stack and the per-layer path, whose logits must be bit-equal; the
embedded SmolLM2 in both CPU dtypes, and tiny checkpoints with a QKV bias (Qwen2) and a
sliding window (Mistral). Models the native sequence does not mirror keep the per-layer
path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from family_parity import build_hf, prompts

from kvflow.kernels import cpu as cpu_kernels
from kvflow.runtime.engine import Engine
from kvflow.runtime.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def _native(dtype: str) -> bool:
    torch_dtype = getattr(torch, dtype)
    return cpu_kernels.gemm.supports(torch.empty(16, 16, dtype=torch_dtype))


def _check_every_step(runner: ModelRunner) -> list[int]:
    """Make ``runner.forward`` run each decode batch both ways and compare the logits; the
    returned list fills with the batch sizes checked."""
    graph = runner.cpu_graph
    assert graph is not None
    checked: list[int] = []
    per_layer = runner.forward

    @torch.inference_mode()
    def forward(fb):
        if not graph.can_run(fb):
            return per_layer(fb)
        got = graph.replay(fb)
        runner.attn.init_forward_metadata(fb)  # the same K/V stored again: a no-op
        expected = runner.run_model(fb)
        assert torch.equal(got, expected), f"batch of {fb.batch_size}"
        checked.append(fb.batch_size)
        return got

    runner.forward = forward  # type: ignore[method-assign]
    return checked


def _engine(path: str | None, **engine: Any) -> Engine:
    return Engine(path, skip_tokenizer_init=True, **engine)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_embedded_model_logits_equal(dtype):
    if not _native(dtype):
        pytest.skip(f"no native {dtype} matmul on this CPU")
    llm = _engine(None, dtype=dtype)
    checked = _check_every_step(llm.runner)
    batch = prompts((3, 41, 17))
    llm.generate(input_ids=batch, sampling_params=GREEDY)
    llm.generate(input_ids=batch[1], sampling_params=GREEDY)
    assert 3 in checked and 1 in checked


@pytest.mark.parametrize(
    ("model_cls", "config_cls", "config"),
    [
        ("Qwen2ForCausalLM", "Qwen2Config", {"num_key_value_heads": 2}),
        ("MistralForCausalLM", "MistralConfig", {"num_key_value_heads": 2, "sliding_window": 16}),
    ],
    ids=["qkv-bias", "sliding-window"],
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tiny_families_logits_equal(tmp_path, model_cls, config_cls, config, dtype):
    if not _native(dtype):
        pytest.skip(f"no native {dtype} matmul on this CPU")
    build_hf(tmp_path, model_cls, config_cls, **config)
    llm = _engine(str(tmp_path), dtype=dtype)
    checked = _check_every_step(llm.runner)
    llm.generate(input_ids=prompts(), sampling_params=GREEDY)
    assert checked


def test_qk_norm_family_keeps_the_per_layer_path(tmp_path):
    build_hf(tmp_path, "Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=2, head_dim=16)
    assert _engine(str(tmp_path), dtype="float32").runner.cpu_graph is None


def test_switched_off(monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_DECODE_GRAPH", "0")
    assert _engine(None, dtype="float32").runner.cpu_graph is None
