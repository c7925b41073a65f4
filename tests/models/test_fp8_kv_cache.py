"""``--kv-cache-dtype fp8_e4m3 | fp8_e5m2`` end to end: a tiny Llama checkpoint with
``k_scale`` / ``v_scale`` tensors of its own (not 1.0) served by kvflow with an FP8 KV cache,
against transformers whose KV cache rounds every key and value through FP8 the way
kvflow's pool does (``clamp(x / scale)`` to FP8, read back times the scale), token for
token, in float32 on CPU, on both CPU attention backends.

The reference does its own rounding in plain torch (not kvflow's), and its attention reads
every key and value from that cache, as kvflow's does (the new tokens' included).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_parity import MAX_NEW, build_hf, engine_greedy, prompts

from kvflow.kernels import cpu as cpu_kernels

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# per layer (k_scale, v_scale): the first layer's keys saturate FP8 where they exceed
# 0.005 * 448 (if kvflow ignored the scale, nothing would); the second's are large
SCALES = ((0.005, 0.02), (0.6, 1.5))


def _rounded(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype).float() * scale


def _fp8_cache(dtype: torch.dtype, scales: tuple[tuple[float, float], ...]):
    from transformers import DynamicCache

    class Fp8RoundedCache(DynamicCache):
        """transformers' cache, each new key and value rounded through FP8 before it is
        kept (and before attention reads it back)."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k_scale, v_scale = scales[layer_idx]
            keys = _rounded(key_states, k_scale, dtype).to(key_states.dtype)
            values = _rounded(value_states, v_scale, dtype).to(value_states.dtype)
            return super().update(keys, values, layer_idx, *args, **kwargs)

    return Fp8RoundedCache


def _greedy_fp8(hf, batch, dtype, scales) -> list[list[int]]:
    cache_cls = _fp8_cache(dtype, scales)
    outputs = []
    with torch.no_grad():
        for ids in batch:
            full = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=0,
                past_key_values=cache_cls(),
            )
            outputs.append(full[0, len(ids) :].tolist())
    return outputs


def _add_kv_scales(folder: Path, scales: tuple[tuple[float, float], ...]) -> None:
    """Write the scales into the checkpoint as FP8 checkpoints name them (one layer as the
    HF / compressed-tensors ``self_attn.k_scale``, one as ModelOpt's
    ``self_attn.k_proj.k_scale``)."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    for layer, (k_scale, v_scale) in enumerate(scales):
        attn = f"model.layers.{layer}.self_attn"
        k_name, v_name = (
            (f"{attn}.k_scale", f"{attn}.v_scale")
            if layer == 0
            else (f"{attn}.k_proj.k_scale", f"{attn}.v_proj.v_scale")
        )
        tensors[k_name] = torch.tensor(k_scale)
        tensors[v_name] = torch.tensor(v_scale)
    save_file(tensors, str(file))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8kv")
    hf = build_hf(folder, "LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2)
    _add_kv_scales(folder, SCALES)
    return folder, hf


def _backends() -> list[str]:
    return ["torch", "cpu"] if cpu_kernels.available() else ["torch"]


# transformers >= 5 renames generate's past_key_values (kvflow supports >= 4.46)
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
def test_fp8_kv_cache_equals_transformers_with_an_fp8_rounded_cache(checkpoint, kv_cache_dtype):
    folder, hf = checkpoint
    batch = prompts()
    expected = _greedy_fp8(hf, batch, FP8[kv_cache_dtype], SCALES)
    # the test can fail: the checkpoint's scales change tokens (so does the rounding)
    assert expected != _greedy_fp8(hf, batch, FP8[kv_cache_dtype], ((1.0, 1.0),) * 2)
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
