"""Gemma 2 and Gemma 3 (text) against transformers on tiny random checkpoints: greedy
tokens token for token, with prompts and outputs longer than the sliding window (16 here)
of the local layers, soft-capped attention scores, a radix-cache hit on the repeated batch,
on the torch, cpu and (interpreted) triton backends; the final soft-capping through the
logprobs it changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from family_parity import GREEDY, MAX_NEW, build_hf, hf_greedy, prompts
from tp_ranks import run_ranks

from kvflow.kernels import cpu as cpu_kernels
from kvflow.runtime.config import ModelConfig
from kvflow.runtime.models import check_supported

WINDOW = 16
COMMON = {
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "sliding_window": WINDOW,
    "query_pre_attn_scalar": 24,  # not head_dim: the scale must come from it
    "eos_token_id": 2,
    "attn_implementation": "eager",  # transformers' soft-capping path
}
GEMMA2 = {**COMMON, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}
# one global layer in three (pattern 3), local RoPE base and scaled global RoPE apart
GEMMA3 = {
    **COMMON,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 1
    + ["sliding_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 100000.0},
    },
    "attn_logit_softcapping": None,  # transformers' Gemma 3 ignores it (refused here)
    "final_logit_softcapping": 3.0,
}
FAMILIES = {
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", GEMMA2),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3),
}
ENGINE = {"chunked_prefill_size": 12, "dtype": "float32", "skip_tokenizer_init": True}
BACKENDS = [
    "torch",
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler"),
    ),
]


def build_gemma(folder: Path, family: str, **overrides: Any) -> torch.nn.Module:
    """:func:`build_hf` with every Gemma norm weight random too (they are offsets from 1,
    zero at init, which would hide a norm that ignores them)."""
    model_cls, config_cls, config = FAMILIES[family]
    hf = build_hf(folder, model_cls, config_cls, **{**config, **overrides})
    torch.manual_seed(2)
    for name, param in hf.named_parameters():
        if name.endswith("norm.weight"):
            param.data.normal_(0, 0.3)
    hf.save_pretrained(folder)
    return hf


def _engine_twice(folder: Path, batch: list[list[int]], **engine: Any) -> tuple[list, list, Any]:
    """The batch through one engine twice (the second time its prefixes hit the radix
    cache); checks that no KV memory leaks."""
    from kvflow.runtime.engine import Engine

    llm = Engine(str(folder), **engine)
    first, second = (
        [r.output_ids for r in llm.generate(input_ids=batch, sampling_params=GREEDY)]
        for _ in range(2)
    )
    assert llm.is_memory_free()
    return first, second, llm.scheduler


def test_gemma_configs(tmp_path):
    build_gemma(tmp_path / "2", "gemma2")
    config = ModelConfig.from_path(tmp_path / "2")
    assert config.tie_word_embeddings and config.hidden_act == "gelu_pytorch_tanh"
    assert [config.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert config.attention_scale == 24**-0.5
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (2.0, 3.0)
    build_gemma(tmp_path / "3", "gemma3")
    config = ModelConfig.from_path(tmp_path / "3")
    assert [config.layer_window(i) for i in range(4)] == [WINDOW, WINDOW, None, WINDOW]
    assert (config.rope_theta, config.rope_local_base_freq) == (100000.0, 500.0)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}


def test_gemma_hub_style_configs():
    """Configs as the Hub ships them (no layer_types, no tie_word_embeddings key)."""
    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 6}
    base |= {"num_attention_heads": 1, "sliding_window": 4}
    gemma2 = ModelConfig.from_dict({**base, "architectures": ["Gemma2ForCausalLM"]})
    assert gemma2.sliding_layers == (0, 2, 4) and gemma2.tie_word_embeddings
    gemma3 = ModelConfig.from_dict(
        {
            **base,
            "architectures": ["Gemma3ForCausalLM"],
            "sliding_window_pattern": 3,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        }
    )
    assert gemma3.sliding_layers == (0, 1, 3, 4)
    assert (gemma3.rope_theta, gemma3.rope_local_base_freq) == (1e6, 1e4)
    assert gemma3.rope_type == "linear"
    with pytest.raises(ValueError, match="hidden_activation 'gelu'"):
        check_supported(ModelConfig.from_dict({**base, "architectures": ["Gemma2ForCausalLM"],
                                               "hidden_activation": "gelu"}))  # fmt: skip
    capped = {**base, "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0}
    with pytest.raises(ValueError, match="does not apply it"):
        check_supported(ModelConfig.from_dict(capped))
    with pytest.raises(ValueError, match="multimodal"):
        ModelConfig.from_dict(
            {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": base}
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_gemma_equals_transformers(tmp_path, family, backend):
    hf = build_gemma(tmp_path, family)
    batch = prompts()
    assert max(map(len, batch)) > 3 * WINDOW
    expected = hf_greedy(hf, batch)
    first, second, scheduler = _engine_twice(tmp_path, batch, attention_backend=backend, **ENGINE)
    assert first == expected
    assert second == expected
    assert scheduler.kv.hit_tokens.device > 0, "the repeated prompts must hit the radix cache"


@pytest.mark.parametrize("family", FAMILIES)
def test_gemma_features_change_the_output(tmp_path, family):
    """The window (and Gemma 2's attention soft-capping) matter here: without them, greedy
    decodes otherwise."""
    batch = prompts()
    expected = hf_greedy(build_gemma(tmp_path / "ref", family), batch)
    if family == "gemma2":
        uncapped = build_gemma(tmp_path / "nocap", family, attn_logit_softcapping=None)
        assert hf_greedy(uncapped, batch) != expected
    unwindowed = build_gemma(tmp_path / "full", family, sliding_window=512)  # > any length
    assert hf_greedy(unwindowed, batch) != expected


@pytest.mark.parametrize("family", FAMILIES)
def test_gemma_final_softcap_logprobs(tmp_path, family):
    """Greedy ids ignore the final soft-capping (tanh is monotonic); its logprobs do not."""
    from kvflow.runtime.engine import Engine

    hf = build_gemma(tmp_path, family)
    ids = prompts((41,))[0]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),  # (not inferred)
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    logits = torch.cat(out.logits).float()  # [new, vocab], soft-capped by transformers
    assert logits.abs().max() < 3.0
    expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
    llm = Engine(str(tmp_path), **ENGINE)
    (result,) = llm.generate(input_ids=[ids], sampling_params=GREEDY, return_logprob=True)
    assert result.output_ids == tokens
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_gemma_tp2_equals_transformers(tmp_path, family):
    """One KV head per rank, each rank soft-capping and sliding its own heads; the GeGLU
    width split, the norms whole on both."""
    hf = build_gemma(tmp_path, family)
    batch = prompts((41, 17, 5))
    expected = hf_greedy(hf, batch)
    calls = [{"input_ids": batch, "sampling_params": GREEDY}]
    reports = run_ranks(2, str(tmp_path), calls, attention_backend="torch", **ENGINE)
    assert [r["outputs"] for r in reports] == [[expected]] * 2
    assert [r["kv_heads"] for r in reports] == [1, 1]


# The triton backend on CPU runs its kernels under Triton's interpreter, which must be on
# before triton is imported: a subprocess.
TRITON_SCRIPT = textwrap.dedent("""
    import json, sys
    from kvflow.runtime.engine import Engine
    folder, batch, engine, greedy = json.loads(sys.argv[1])
    llm = Engine(folder, device="cpu", **{"attention_backend": "triton", **engine})
    outputs = [
        [r.output_ids for r in llm.generate(input_ids=batch, sampling_params=greedy)]
        for _ in range(2)
    ]
    assert llm.is_memory_free()
    print(json.dumps([outputs, llm.scheduler.kv.hit_tokens.device]))
""")


# Gemma 2 only: its alternating local/global layers and soft-capped scores are what the
# kernels do differently; Gemma 3 adds nothing inside them (q/k norm and its two RoPE tables
# are outside the attention kernels) and runs on Triton in tests/gpu/test_gpu_gemma.py. Each
# interpreted run costs about 50 s of make test.
@pytest.mark.parametrize("family", ["gemma2"])
def test_gemma_triton_backend_equals_transformers(tmp_path, family):
    """The Triton decode and extend kernels (interpreted on CPU) soft-cap and slide the
    same way."""
    hf = build_gemma(tmp_path, family)
    batch = prompts((41, 17, 5))
    expected = hf_greedy(hf, batch)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    argv = json.dumps([str(tmp_path), batch, ENGINE, GREEDY])
    done = subprocess.run(
        [sys.executable, "-P", "-c", TRITON_SCRIPT, argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outputs, hits = json.loads(done.stdout.strip().splitlines()[-1])
    assert outputs == [expected, expected]
    assert hits > 0
