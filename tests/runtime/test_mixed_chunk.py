"""Mixed chunked prefill: running requests decode in the same step as a prefill chunk, so
arrivals do not stall them; greedy outputs are those of plain scheduling."""

from __future__ import annotations

import pytest

from kvflow.runtime.scheduler import Req
from kvflow.runtime.wire import GenerateRequest, SamplingParams

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
LATE = "<|im_start|>user\nName three colours of the rainbow, please.<|im_end|>\n<|im_start|>assistant\n"


def _staggered(engine) -> tuple[dict[str, list[int]], list[int]]:
    """Two early requests decode; three arrive later with a long prompt (chunked in mixed
    mode). Returns each request's output ids and, per step, how many early tokens it made."""
    sched = engine.scheduler
    early_ids, late_ids = engine.encode(PROMPT), engine.encode(LATE * 4)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    early = [
        Req(GenerateRequest(rid=f"early-{i}", input_ids=early_ids, sampling=params))
        for i in range(2)
    ]
    late = [
        Req(GenerateRequest(rid=f"late-{i}", input_ids=[*late_ids, 100 + i], sampling=params))
        for i in range(3)
    ]
    for req in early:
        sched.add_request(req)
    for _ in range(4):
        sched.step()
    for req in late:
        sched.add_request(req)
    progress = []
    while sched.has_work():
        before = sum(len(r.output_ids) for r in early)
        sched.step()
        progress.append(sum(len(r.output_ids) for r in early) - before)
    return {r.rid: list(r.output_ids) for r in early + late}, progress


@pytest.fixture(scope="module")
def engines(model_path):
    from kvflow.runtime.engine import Engine

    plain = Engine(str(model_path), disable_radix_cache=True)
    mixed = Engine(
        str(model_path), disable_radix_cache=True, enable_mixed_chunk=True, mixed_chunk_size=32
    )
    yield plain, mixed
    assert plain.is_memory_free() and mixed.is_memory_free()


def test_mixed_steps_keep_decoding_and_match_plain_greedy(engines):
    plain, mixed = engines
    assert mixed.config.mixed_chunk_size == 32
    plain_out, plain_progress = _staggered(plain)
    mixed_out, mixed_progress = _staggered(mixed)
    assert mixed_out == plain_out
    # plain scheduling stalls the early requests while the late prompts prefill...
    stalled = next(i for i, made in enumerate(plain_progress) if made == 0)
    assert stalled == 0
    # ...mixed scheduling makes a token of each early request in every step until they end
    early_left = [made for made in mixed_progress if made][: 24 - 4]
    assert mixed_progress[: len(early_left)] == [2] * len(early_left)
    assert mixed.scheduler.kv.is_fully_free()


def test_mixed_chunk_size_defaults_by_device():
    from kvflow.runtime.config import EngineConfig

    assert EngineConfig(device="cpu").resolved().mixed_chunk_size == 96
    assert EngineConfig(device="cpu", mixed_chunk_size=64).resolved().mixed_chunk_size == 64
