"""HiCache with an FP8 KV cache (``--kv-cache-dtype fp8_e4m3``) on a tiny Llama: pages
spill to the host tier and a file store as FP8 bytes and come back unchanged (greedy
outputs equal plain FP8 serving); the store's namespace names the stored dtype, so a
bfloat16 instance on the same store finds none of the FP8 pages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from family_parity import build_hf

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
DEVICE_TOKENS = 96  # two of the prompts cannot stay on the device together


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    build_hf(folder, "LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2)
    return folder


def _prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 500 for j in range(60 + i)] for i in range(3)]


def _rounds(engine) -> list[list[int]]:
    """Each prompt twice, one at a time: the second time its prefix comes from a tier."""
    return [engine.generate(input_ids=p, sampling_params=GREEDY).output_ids for p in _prompts() * 2]


def test_fp8_pages_spill_and_come_back(tiny, tmp_path):
    from kvflow.runtime.engine import Engine

    common = dict(skip_tokenizer_init=True, dtype="float32", max_total_tokens=DEVICE_TOKENS)
    expected = _rounds(Engine(str(tiny), kv_cache_dtype="fp8_e4m3", **common))
    store = dict(
        hicache_host_memory_gb=0.001,
        hicache_storage="file",
        hicache_storage_path=str(tmp_path / "l3"),
        hicache_prefetch_timeout=5.0,
    )
    engine = Engine(str(tiny), kv_cache_dtype="fp8_e4m3", **common, **store)
    cache = engine.scheduler.cache
    assert cache.host.data.element_size() == 1
    assert cache.storage.namespace.dtype == "float8_e4m3fn"
    assert _rounds(engine) == expected
    assert engine.scheduler.kv.hit_tokens.host > 0
    assert cache.storage.io.drain(30.0)
    cache.poll()
    assert cache.storage.io.stats().write_pages > 0
    # a bfloat16 KV cache on the same store: another namespace, no page of the FP8 one
    other = Engine(str(tiny), kv_cache_dtype="bfloat16", **common, **store)
    assert other.scheduler.cache.storage.namespace.digest != cache.storage.namespace.digest
    _rounds(other)
    assert other.scheduler.kv.hit_tokens.storage == 0
    assert engine.is_memory_free() and other.is_memory_free()
