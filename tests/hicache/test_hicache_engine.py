"""HiCache in the engine: a device pool too small for the working set spills prefixes to
host; greedy outputs equal those without HiCache, token for token; later rounds hit the
host tier; all memory (device and host) comes back."""

from __future__ import annotations

import pytest

from kvflow.runtime.mem import KVPool
from kvflow.runtime.wire import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
DEVICE_TOKENS = 320  # one document is ~190 tokens: four of them cannot stay on the device


def host_gb(engine, tokens: int) -> float:
    mc = engine.runner.model_config
    per_token = KVPool.bytes_per_token(
        mc.num_layers, mc.num_kv_heads, mc.head_dim, engine.runner.dtype
    )
    return tokens * per_token / 2**30


@pytest.fixture(scope="module")
def reference(model_path, conversations):
    from kvflow.runtime.engine import Engine

    engine = Engine(str(model_path), dtype="float32", max_total_tokens=DEVICE_TOKENS)
    outputs = [r.output_ids for r in engine.generate(conversations[0], GREEDY)]
    sequential = [[engine.generate(p, GREEDY).output_ids for p in rnd] for rnd in conversations]
    return outputs, sequential


@pytest.mark.parametrize("policy,page_size", [("write_through", 1), ("write_back", 4)])
def test_greedy_outputs_equal_and_later_rounds_hit_host(
    model_path, conversations, reference, policy, page_size
):
    from kvflow.runtime.engine import Engine

    batched_ref, sequential_ref = reference
    probe = Engine(str(model_path), dtype="float32", max_total_tokens=64)
    gb = host_gb(probe, 4096)
    del probe
    engine = Engine(
        str(model_path),
        dtype="float32",  # bfloat16's argmax may differ with the batch's composition
        max_total_tokens=DEVICE_TOKENS,
        page_size=page_size,
        hicache_host_memory_gb=gb,
        hicache_write_policy=policy,
    )
    cache = engine.scheduler.cache
    batched = [r.output_ids for r in engine.generate(conversations[0], GREEDY)]
    assert batched == batched_ref
    sequential = [[engine.generate(p, GREEDY).output_ids for p in rnd] for rnd in conversations]
    assert sequential == sequential_ref
    hits = engine.scheduler.kv.hit_tokens
    assert hits.host > 500, hits  # documents came back from host in later rounds
    assert cache.counters.backed_up_tokens > 0
    assert engine.is_memory_free()
    assert engine.flush_cache()
    assert cache.host_used_size() == 0
    assert engine.runner.allocator.available_size() == engine.runner.allocator.size


def test_a_second_engine_finds_the_first_ones_prefixes_in_the_file_store(
    model_path, conversations, reference, tmp_path
):
    """L3 (file store): pages written by one engine are prefetched by a fresh one; its
    greedy answers are those of plain serving."""
    from kvflow.runtime.engine import Engine

    _, sequential_ref = reference
    options = dict(
        max_total_tokens=DEVICE_TOKENS,
        page_size=16,
        hicache_host_memory_gb=0.02,
        hicache_storage="file",
        hicache_storage_path=str(tmp_path / "l3"),
        hicache_prefetch_timeout=5.0,
    )
    first = Engine(str(model_path), dtype="float32", **options)
    assert [first.generate(p, GREEDY).output_ids for p in conversations[0]] == sequential_ref[0]
    storage = first.scheduler.cache.storage
    assert storage is not None and storage.io.drain(30.0)
    first.scheduler.cache.poll()
    assert storage.io.stats().write_pages > 0
    second = Engine(str(model_path), dtype="float32", **options)
    outputs = [second.generate(p, GREEDY).output_ids for p in conversations[1]]
    assert outputs == sequential_ref[1]
    hits = second.scheduler.kv.hit_tokens
    assert hits.storage > 0, hits
    assert second.is_memory_free() and first.is_memory_free()
