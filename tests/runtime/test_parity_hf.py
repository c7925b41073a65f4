"""Greedy outputs equal Hugging Face transformers' token for token, under every scheduling path."""

from __future__ import annotations

MAX_NEW = 24  # the prompts and transformers' greedy reference: tests/runtime/conftest.py


def _generate(engine, prompts):
    results = engine.generate(
        input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW}
    )
    return [r.output_ids for r in results], results


def test_all_at_once_continuous_batching(make_engine, prompts, hf_greedy):
    engine = make_engine()
    ours, _ = _generate(engine, prompts)
    assert ours == hf_greedy


def test_prefix_cache_hits(make_engine, prompts, hf_greedy):
    engine = make_engine()
    _generate(engine, prompts)
    ours, results = _generate(engine, prompts)  # the same prompts again: prefixes cached
    assert ours == hf_greedy
    assert all(r.cached_tokens >= len(p) - 1 for r, p in zip(results, prompts, strict=True))


def test_shared_prefix_across_prompts(make_engine, prompts, hf_greedy):
    engine = make_engine()
    half = len(prompts) // 2
    _generate(engine, prompts[:half])
    ours, results = _generate(engine, prompts)
    assert ours == hf_greedy
    # the chat header is shared by every prompt, so even new prompts hit the cache
    assert all(r.cached_tokens > 0 for r in results[half:])


def test_chunked_prefill_splits_every_prompt(make_engine, prompts, hf_greedy):
    engine = make_engine(chunked_prefill_size=8)
    assert min(len(p) for p in prompts) > 8
    ours, _ = _generate(engine, prompts)
    assert ours == hf_greedy


def test_small_kv_pool_forces_retraction(make_engine, prompts, hf_greedy):
    engine = make_engine(max_total_tokens=160, disable_radix_cache=True)
    ours, _ = _generate(engine, prompts)
    assert engine.scheduler.num_retractions > 0
    assert ours == hf_greedy


def test_paged_kv_with_radix_cache(make_engine, prompts, hf_greedy):
    engine = make_engine(page_size=4, chunked_prefill_size=12, max_total_tokens=256)
    ours, _ = _generate(engine, prompts)
    again, _ = _generate(engine, prompts)
    assert ours == hf_greedy and again == hf_greedy


def test_fcfs_policy(make_engine, prompts, hf_greedy):
    engine = make_engine(schedule_policy="fcfs", max_running_requests=3)
    ours, _ = _generate(engine, prompts)
    assert ours == hf_greedy
