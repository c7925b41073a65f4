"""In-batch prefix sharing: which waiting requests wait for the batch to cache their prefix."""

from __future__ import annotations

import random

import pytest

from kvflow.runtime.sampling import SamplingParams
from kvflow.runtime.scheduler import Req
from kvflow.runtime.scheduler.sharing import MIN_SHARED_GAIN, BatchPrefixes, common_prefix_len
from kvflow.runtime.wire import GenerateRequest


def naive_common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("seed", range(20))
def test_common_prefix_len_matches_naive(seed):
    rng = random.Random(seed)
    base = [rng.randrange(50) for _ in range(rng.randrange(0, 1200))]
    other = list(base[: rng.randrange(0, len(base) + 1)])
    other += [rng.randrange(50) for _ in range(rng.randrange(0, 600))]
    assert common_prefix_len(base, other) == naive_common_prefix(base, other)


@pytest.mark.parametrize("cut", [0, 1, 255, 256, 257, 511, 512, 700])
def test_common_prefix_len_at_block_edges(cut):
    a = list(range(700))
    b = a[:cut] + [-1] * 10
    assert common_prefix_len(a, b) == cut
    assert common_prefix_len(a, a) == 700 and common_prefix_len(a, a[:cut]) == cut


def req(tokens, rid, extra_key=None):
    return Req(
        GenerateRequest(
            rid=rid,
            input_ids=list(tokens),
            sampling=SamplingParams(max_new_tokens=1),
            extra_key=extra_key,
        )
    )


def test_siblings_wait_for_the_batch_only_when_it_saves_enough():
    prefix = list(range(1000, 1400))
    batch = BatchPrefixes()
    batch.add(req([*prefix, 1, 2, 3], "a"))
    sibling = req([*prefix, 7, 8], "b")
    assert batch.gain(sibling, cached=0) == 400 and batch.should_wait(sibling, cached=0)
    # already cached almost all of it: waiting would save too little
    assert not batch.should_wait(sibling, cached=400 - MIN_SHARED_GAIN + 1)
    # same head, but the prompts part soon after it: waiting saves only what is not cached
    stranger = req(prefix[:40] + [5] * 300, "c")
    assert batch.gain(stranger, cached=0) == 40 and batch.should_wait(stranger, cached=0)
    assert batch.gain(stranger, cached=16) == 24 and not batch.should_wait(stranger, cached=16)
    # another cache namespace never shares
    assert not batch.should_wait(req(prefix, "e", extra_key="lora-1"), cached=0)
    # short prompts are never held back
    assert not batch.should_wait(req(prefix[: MIN_SHARED_GAIN - 1], "f"), cached=0)


def test_shared_prefix_is_computed_once_even_when_chunked(model_path):
    """Four prompts with a 600-token common prefix, prefilled in 256-token chunks."""
    from kvflow.runtime.engine import Engine

    engine = Engine(str(model_path), chunked_prefill_size=256)
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(600)]
    prompts = [prefix + [rng.randrange(100, 40000) for _ in range(10)] for _ in range(4)]
    results = engine.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": 1, "ignore_eos": True}
    )
    assert sorted(r.cached_tokens for r in results) == [0, 600, 600, 600]
    assert engine.is_memory_free()
