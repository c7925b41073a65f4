"""Gemma 2 and Gemma 3 on a GPU: the Triton kernels with soft-capped scores and sliding
local layers inside the engine (CUDA graphs on and off, float32) give transformers' greedy
tokens on tiny random checkpoints; and in the real shapes of the shipped dummy configs
(gemma-2-9b, gemma-3-12b's decoder), kvflow's bfloat16 logits are as close to a float32
reference as transformers' own bfloat16.

Skipped without CUDA; run on the accelerator machine with
``pytest -m gpu tests/gpu/test_gpu_gemma.py``.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
# test_gemma_family imports tests/parallel/tp_ranks.py
sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from family_parity import MAX_NEW, engine_greedy, prompts
from prefill_logits import (
    assert_as_close_as_transformers,
    bf16_runner,
    last_logits,
    transformers_logits,
)
from test_gemma_family import WINDOW, build_gemma

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _first_divergence_is_a_tie(hf, ids: list[int], theirs: list[int], ours: list[int]) -> None:
    """Where the outputs differ, transformers' own logits must (nearly) tie the two tokens
    at the first difference: float32 noise, not a bug (which shows a clear margin)."""
    j = next(i for i, (a, b) in enumerate(zip(theirs, ours, strict=True)) if a != b)
    with torch.no_grad():
        logits = hf(torch.tensor([ids + theirs[:j]])).logits[0, -1]
    margin = float(logits[theirs[j]] - logits[ours[j]])
    assert margin < 1e-4 * float(logits.abs().max()), f"diverged at {j} with margin {margin}"


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_on_cuda_equals_transformers(tmp_path, family, cuda_graph):
    hf = build_gemma(tmp_path, family)
    batch = prompts() + prompts((300, 90))  # 300: a long uncached prompt, many tiles
    assert max(map(len, batch)) > 3 * WINDOW
    with torch.no_grad():
        expected = [
            hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),  # (not inferred)
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
            for ids in batch
        ]
    got = engine_greedy(
        tmp_path,
        batch,
        device="cuda",
        max_running_requests=16,
        cuda_graph_max_bs=16,
        disable_cuda_graph=not cuda_graph,
    )
    exact = sum(a == b for a, b in zip(expected, got, strict=True))
    for ids, theirs, ours in zip(batch, expected, got, strict=True):
        if theirs != ours:
            _first_divergence_is_a_tie(hf, ids, theirs, ours)
    assert exact >= len(batch) - 1, f"only {exact} of {len(batch)} prompts matched exactly"


@pytest.mark.parametrize(
    ("name", "config_cls", "model_cls"),
    [
        ("gemma-2-9b", "Gemma2Config", "Gemma2ForCausalLM"),
        ("gemma-3-12b", "Gemma3TextConfig", "Gemma3ForCausalLM"),
    ],
)
def test_real_shapes_logits_close_in_bf16(name, config_cls, model_cls):
    """A 5000-token prompt (past gemma-2-9b's 4096 window and gemma-3-12b's 1024) in one
    extend: kvflow's bf16 last logits against a float32 transformers reference, no farther
    than transformers' own bf16 (1.5x slack)."""
    import transformers

    from kvflow.runtime.config import DUMMY_CONFIGS

    raw = json.loads(DUMMY_CONFIGS[name].read_text())
    length = 5000
    torch.manual_seed(0)
    ids = torch.randint(0, raw["vocab_size"], (length,), device="cuda")
    hf_config = getattr(transformers, config_cls)(**raw, attn_implementation="eager")
    with torch.device("cuda"):
        hf = getattr(transformers, model_cls)(hf_config).to(torch.float32).eval()
    for param_name, param in hf.named_parameters():  # Gemma norms are offsets from 1
        if param_name.endswith("norm.weight"):
            param.data.normal_(0, 0.1)
    reference, hf_bf16 = transformers_logits(hf, ids, logits_to_keep=1)
    runner = bf16_runner(name, load_format="dummy", max_total_tokens=length + 64)
    runner.model.load_weights((n, t) for n, t in hf.state_dict().items())
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    assert_as_close_as_transformers(name, last_logits(runner, ids), hf_bf16, reference)
