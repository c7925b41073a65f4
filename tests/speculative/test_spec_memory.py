"""Speculation under aborts, retraction and sampling: no KV leaks (the target's pool and
the STANDALONE, EAGLE and EAGLE3 drafts'), greedy tokens unchanged under retraction, seeded sampling
reproducible."""

from __future__ import annotations

import pytest

from kvflow.runtime.sampling import SamplingParams
from kvflow.runtime.scheduler import Req
from kvflow.runtime.wire import GenerateRequest

PROMPTS = [[(3 * i + j % (2 + i)) % 90 for j in range(12 + 5 * i)] for i in range(4)]


def _specs(tiny_models, eagle_heads):
    return {
        "ngram": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
        "standalone": {
            "speculative_algorithm": "STANDALONE",
            "speculative_draft_model_path": tiny_models["target"],
            "speculative_num_steps": 3,
        },
        "eagle": {
            "speculative_algorithm": "EAGLE",
            "speculative_draft_model_path": eagle_heads["random"],
            "speculative_num_steps": 3,
        },
        "eagle3": {
            "speculative_algorithm": "EAGLE3",
            "speculative_draft_model_path": eagle_heads["eagle3"],
            "speculative_num_steps": 3,
        },
    }


@pytest.mark.parametrize("algorithm", ["ngram", "standalone", "eagle", "eagle3"])
def test_abort_between_verify_steps_leaks_no_kv(tiny_models, tiny_engine, eagle_heads, algorithm):
    spec = _specs(tiny_models, eagle_heads)[algorithm]
    engine = tiny_engine(tiny_models["target"], page_size=4, **spec)
    sched = engine.scheduler
    params = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    reqs = [
        Req(GenerateRequest(rid=f"r{i}", input_ids=ids, sampling=params))
        for i, ids in enumerate(PROMPTS)
    ]
    for req in reqs:
        sched.add_request(req)
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        if steps == 3:  # r1 has verified a step (and the draft holds its KV)
            assert sched.abort_request("r1") is not None
        if steps == 5:
            assert sched.abort_request("r3") is not None
    assert [r.finished_reason.type for r in reqs] == ["length", "abort", "length", "abort"]
    assert engine.is_memory_free()


@pytest.mark.parametrize("algorithm", ["ngram", "standalone", "eagle", "eagle3"])
def test_retraction_keeps_greedy_tokens(tiny_models, tiny_engine, eagle_heads, algorithm):
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    plain = tiny_engine(tiny_models["target"], page_size=4)
    want = [r.output_ids for r in plain.generate(input_ids=PROMPTS, sampling_params=params)]
    # a pool that cannot hold every request's output at once: some are retracted
    small = tiny_engine(
        tiny_models["target"],
        page_size=4,
        max_total_tokens=112,
        **_specs(tiny_models, eagle_heads)[algorithm],
    )
    got = small.generate(input_ids=PROMPTS, sampling_params=params)
    assert [r.output_ids for r in got] == want
    assert small.scheduler.num_retractions > 0
    assert small.is_memory_free()


@pytest.mark.parametrize("algorithm", ["standalone", "eagle"])
def test_seeded_sampling_is_reproducible(tiny_models, tiny_engine, eagle_heads, algorithm):
    engine = tiny_engine(tiny_models["target"], **_specs(tiny_models, eagle_heads)[algorithm])
    params = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 20, "seed": 3, "ignore_eos": True}
    first = [r.output_ids for r in engine.generate(input_ids=PROMPTS, sampling_params=params)]
    again = [r.output_ids for r in engine.generate(input_ids=PROMPTS, sampling_params=params)]
    assert first == again
    assert all(len(ids) == 20 for ids in first)
    assert engine.scheduler.spec.drafted_tokens > 0  # (a random model's p(d) is small)
    assert engine.is_memory_free()


def _pool_bytes(runner) -> int:
    pool = runner.kv_pool
    return sum(buf.numel() * buf.element_size() for buf in (*pool.k_buffer, *pool.v_buffer))


@pytest.mark.parametrize("algorithm", ["standalone", "eagle"])
def test_the_kv_budget_holds_the_draft_pool_too(tiny_models, tiny_engine, eagle_heads, algorithm):
    """The draft's pool gets as many slots as the target's, so the target sizes its own
    with the draft's bytes per token counted (runtime/models/draft_footprint.py): together
    they stay within the budget (``cpu_kv_cache_gb`` here; on CUDA the memory fraction,
    less the draft's weights), where before the draft's pool came on top of it."""
    budget_gb = 1 / 1024  # 1 MiB
    plain = tiny_engine(tiny_models["target"], max_total_tokens=None, cpu_kv_cache_gb=budget_gb)
    spec = _specs(tiny_models, eagle_heads)[algorithm]
    engine = tiny_engine(
        tiny_models["target"], max_total_tokens=None, cpu_kv_cache_gb=budget_gb, **spec
    )
    target = engine.runner
    draft = engine.scheduler.spec.drafter.runner
    assert draft.allocator.size == target.allocator.size
    assert target.allocator.size < plain.runner.allocator.size
    hidden = 0 if target.hidden_pool is None else target.hidden_pool.numel() * 4  # float32
    assert _pool_bytes(target) + hidden + _pool_bytes(draft) <= budget_gb * (1 << 30) * 1.01
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    assert all(r.output_ids for r in engine.generate(input_ids=PROMPTS, sampling_params=params))
    assert engine.is_memory_free()
