"""``--kv-cache-dtype fp8_e4m3 | fp8_e5m2`` end to end: a tiny Llama checkpoint with
``k_scale`` / ``v_scale`` tensors of its own (not 1.0) served by kvflow with an FP8 KV cache,
against transformers whose KV cache rounds every key and value through FP8 the way
kvflow's pool does (``clamp(x / scale)`` to FP8, read back times the scale), token for
token, in float32 on CPU, on both CPU attention backends.

The reference does its own rounding in plain torch (not kvflow's), and its attention reads
every key and value from that cache, as kvflow's does (the new tokens' included).
"""

from __future__ import annotations

import pytest
import torch
from family_parity import build_hf, engine_greedy, prompts
from fp8_kv_reference import FP8, SCALES, add_kv_scales, greedy_fp8

from kvflow.kernels import cpu as cpu_kernels


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8kv")
    hf = build_hf(folder, "LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2)
    add_kv_scales(folder, SCALES)
    return folder, hf


def _backends() -> list[str]:
    return ["torch", "cpu"] if cpu_kernels.available() else ["torch"]


# 4 prompts of family_parity's 8 (test time); they reach the cached-prefix decode path
PROMPT_LENGTHS = (3, 41, 64, 12)
# transformers >= 5 renames generate's past_key_values (kvflow supports >= 4.46)
IGNORE_RENAME = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


@IGNORE_RENAME
@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
def test_fp8_kv_cache_equals_transformers_with_an_fp8_rounded_cache(checkpoint, kv_cache_dtype):
    folder, hf = checkpoint
    batch = prompts(PROMPT_LENGTHS)
    expected = greedy_fp8(hf, batch, FP8[kv_cache_dtype], SCALES)
    if kv_cache_dtype == "fp8_e4m3":  # the test can fail: the checkpoint's scales matter
        assert expected != greedy_fp8(hf, batch, FP8[kv_cache_dtype], ((1.0, 1.0),) * 2)
    for backend in _backends():
        got = engine_greedy(folder, batch, kv_cache_dtype=kv_cache_dtype, attention_backend=backend)
        assert got == expected, backend


def test_pool_takes_the_checkpoint_scales_and_twice_the_tokens(checkpoint):
    """The checkpoint's scales reach the pool (rounded to float32, as saved); the same
    --cpu-kv-cache-gb holds twice the tokens in FP8 as in bfloat16."""
    from kvflow.runtime.engine import Engine

    folder, _ = checkpoint
    pools = {}
    for kv in ("bfloat16", "fp8_e4m3"):
        engine = Engine(
            str(folder), skip_tokenizer_init=True, kv_cache_dtype=kv, cpu_kv_cache_gb=0.01
        )
        pools[kv] = (engine.runner.allocator.size, engine.runner.kv_pool)
    (bf16_tokens, bf16_pool), (fp8_tokens, fp8_pool) = pools["bfloat16"], pools["fp8_e4m3"]
    assert fp8_tokens == 2 * bf16_tokens
    assert bf16_pool.dtype == torch.bfloat16 and bf16_pool.k_scales == (1.0, 1.0)
    assert fp8_pool.dtype == torch.float8_e4m3fn
    saved = torch.tensor(SCALES, dtype=torch.float32)
    assert fp8_pool.k_scales == tuple(saved[:, 0].tolist())
    assert fp8_pool.v_scales == tuple(saved[:, 1].tolist())


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_speculative_decoding_over_an_fp8_cache_keeps_greedy_tokens(checkpoint, algorithm):
    """Verify steps extend over FP8 KV (STANDALONE's draft keeps its own FP8 pool, with its
    checkpoint's scales): the tokens are those of plain FP8 decoding."""
    folder, _ = checkpoint
    batch = prompts(PROMPT_LENGTHS)
    plain = engine_greedy(folder, batch, kv_cache_dtype="fp8_e4m3")
    draft = {"speculative_draft_model_path": str(folder)} if algorithm == "STANDALONE" else {}
    spec = engine_greedy(
        folder, batch, kv_cache_dtype="fp8_e4m3", speculative_algorithm=algorithm, **draft
    )
    assert spec == plain
