"""Mistral v0.1 against transformers: every layer slides its attention over a window
shorter than the prompts and outputs (16 tokens here), greedy token for token, on the torch
and cpu backends and at tp 2, with chunked prefill, radix hits and retraction in play."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from family_parity import GREEDY, build_hf, hf_greedy, prompts
from tp_ranks import run_ranks

from kvflow.kernels import cpu as cpu_kernels
from kvflow.runtime.config import ModelConfig

WINDOW = 16
MISTRAL = {"num_key_value_heads": 2, "sliding_window": WINDOW, "eos_token_id": 2}
# chunks shorter than the window and than most prompts; a pool too small for the batch's
# outputs, so the scheduler retracts
ENGINE = {
    "chunked_prefill_size": 12,
    "max_total_tokens": 160,
    "dtype": "float32",
    "skip_tokenizer_init": True,
}
BACKENDS = [
    "torch",
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler"),
    ),
]


def _engine_twice(folder, batch: list[list[int]], **engine: Any) -> tuple[list, list, Any]:
    """The batch through one engine twice (the second time its prefixes hit the radix
    cache): both outputs and the scheduler; checks that no KV memory leaks."""
    from kvflow.runtime.engine import Engine

    llm = Engine(str(folder), **engine)
    first, second = (
        [r.output_ids for r in llm.generate(input_ids=batch, sampling_params=GREEDY)]
        for _ in range(2)
    )
    assert llm.is_memory_free()
    return first, second, llm.scheduler


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
    print(json.dumps([outputs, llm.scheduler.num_retractions]))
""")


def test_mistral_config_slides_every_layer(tmp_path):
    build_hf(tmp_path, "MistralForCausalLM", "MistralConfig", **MISTRAL)
    config = ModelConfig.from_path(tmp_path)
    assert config.sliding_window == WINDOW
    assert [config.layer_window(i) for i in range(config.num_layers)] == [WINDOW, WINDOW]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mistral_sliding_window_equals_transformers(tmp_path, backend):
    hf = build_hf(tmp_path, "MistralForCausalLM", "MistralConfig", **MISTRAL)
    batch = prompts()
    assert max(map(len, batch)) > 3 * WINDOW
    expected = hf_greedy(hf, batch)
    first, second, scheduler = _engine_twice(tmp_path, batch, attention_backend=backend, **ENGINE)
    assert first == expected
    assert second == expected
    assert scheduler.num_retractions > 0, "the test must make the scheduler retract"
    assert scheduler.kv.hit_tokens.device > 0, "the repeated prompts must hit the radix cache"


def test_mistral_triton_backend_equals_transformers(tmp_path):
    """The Triton decode and extend kernels (interpreted on CPU) slide the same window."""
    hf = build_hf(tmp_path, "MistralForCausalLM", "MistralConfig", **MISTRAL)
    batch = prompts((41, 17, 64, 5, 29))
    expected = hf_greedy(hf, batch)
    engine = {**ENGINE, "max_total_tokens": 145}  # retracts with five prompts
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    argv = json.dumps([str(tmp_path), batch, engine, GREEDY])
    done = subprocess.run(
        [sys.executable, "-P", "-c", TRITON_SCRIPT, argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outputs, retractions = json.loads(done.stdout.strip().splitlines()[-1])
    assert outputs == [expected, expected]
    assert retractions > 0


def test_mistral_window_changes_the_output(tmp_path):
    """The window matters here: full attention over the same weights decodes otherwise."""
    hf = build_hf(tmp_path / "w", "MistralForCausalLM", "MistralConfig", **MISTRAL)
    full = build_hf(
        tmp_path / "f", "MistralForCausalLM", "MistralConfig", **{**MISTRAL, "sliding_window": None}
    )
    batch = prompts()
    assert hf_greedy(hf, batch) != hf_greedy(full, batch)


def test_mistral_tp2_equals_transformers(tmp_path):
    """One KV head per rank, each rank sliding the same window."""
    hf = build_hf(tmp_path, "MistralForCausalLM", "MistralConfig", **MISTRAL)
    batch = prompts()
    expected = hf_greedy(hf, batch)
    calls = [{"input_ids": batch, "sampling_params": GREEDY}] * 2
    reports = run_ranks(2, str(tmp_path), calls, **ENGINE)
    for report in reports:
        assert report["outputs"] == [expected, expected]
        assert report["memory_free"]
        assert report["kv_heads"] == 1
    assert reports[0]["retractions"] > 0
