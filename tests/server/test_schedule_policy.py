"""Waiting-queue orders: ``lpm`` offers the longest cached prefix first, ``fcfs`` keeps arrival
order, retracted requests go first under both. Checked on the policy with a real radix
cache, and on a real scheduler whose budget admits one request per step."""

from __future__ import annotations

import gc

import pytest
import torch

from kvflow.runtime.cache import RadixCache
from kvflow.runtime.core import Req
from kvflow.runtime.mem import ReqToTokenPool, TokenToKVPoolAllocator
from kvflow.runtime.scheduler.policy import LPM_MAX_QUEUE, LPM_MAX_WAIT_S, order_waiting
from kvflow.runtime.wire import GenerateRequest, SamplingParams

PARAMS = SamplingParams(max_new_tokens=2, temperature=0)


def _cache_with(*prefixes: list[int]) -> RadixCache:
    cache = RadixCache(ReqToTokenPool(4, 256, "cpu"), TokenToKVPoolAllocator(256, 1, "cpu"))
    for tokens in prefixes:
        slots = torch.tensor(cache.allocator.alloc_for_request(0, 0, len(tokens)))
        already = cache.insert(tokens, slots)
        if already:
            cache.allocator.free(slots[:already])
    return cache


def _order(
    policy: str, waiting: list[Req], cache: RadixCache, now: float | None = None
) -> list[str]:
    def match_len(req: Req) -> int:
        return len(cache.match_prefix(req.all_token_ids()[:-1], req.extra_key).kv_indices)

    return [r.rid for r in order_waiting(policy, waiting, match_len, now)]


@pytest.fixture
def queue() -> tuple[list[Req], RadixCache]:
    shared = list(range(100, 140))
    cache = _cache_with(shared, [7, 8, 9, 10, 11])
    waiting = [
        Req(
            GenerateRequest(rid="none", input_ids=[1, 2, 3, 4], sampling=PARAMS)
        ),  # no cached prefix, arrived first
        Req(
            GenerateRequest(rid="short", input_ids=[7, 8, 9, 50, 51], sampling=PARAMS)
        ),  # 3 cached tokens
        Req(
            GenerateRequest(rid="long", input_ids=[*shared, 60, 61], sampling=PARAMS)
        ),  # 40 cached tokens
        Req(
            GenerateRequest(rid="medium", input_ids=[*shared[:20], 70], sampling=PARAMS)
        ),  # 20 cached tokens
        Req(
            GenerateRequest(
                rid="other-ns", input_ids=[*shared, 80], sampling=PARAMS, extra_key="ns"
            )
        ),  # another namespace: 0
    ]
    return waiting, cache


def test_lpm_orders_by_cached_prefix_length(queue):
    waiting, cache = queue
    assert _order("lpm", waiting, cache) == ["long", "medium", "short", "none", "other-ns"]


def test_fcfs_keeps_arrival_order(queue):
    waiting, cache = queue
    assert _order("fcfs", waiting, cache) == ["none", "short", "long", "medium", "other-ns"]


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_retracted_requests_go_first(queue, policy):
    waiting, cache = queue
    waiting[3].retractions = 1  # "medium"
    assert _order(policy, waiting, cache)[0] == "medium"


def test_lpm_falls_back_to_fcfs_on_a_long_queue(queue):
    waiting, cache = queue
    filler = [
        Req(GenerateRequest(rid=f"f{i}", input_ids=[1, 2, 3], sampling=PARAMS))
        for i in range(LPM_MAX_QUEUE)
    ]
    order = _order("lpm", [*waiting, *filler], cache)
    assert order[:5] == ["none", "short", "long", "medium", "other-ns"]


def test_unknown_policy_is_refused(queue):
    waiting, cache = queue
    with pytest.raises(ValueError, match="unknown schedule policy"):
        _order("random", waiting, cache)


@pytest.mark.parametrize(("policy", "first"), [("lpm", "cached"), ("fcfs", "fresh")])
def test_scheduler_admits_in_policy_order(model_path, policy, first):
    """One request fits per step (max_running_requests=1): the policy decides which."""
    from kvflow.runtime.engine import Engine

    engine = Engine(str(model_path), schedule_policy=policy, max_running_requests=1)
    shared = engine.encode("The history of the city of Lyon in France is long and rich. " * 3)
    engine.generate(input_ids=shared, sampling_params={"max_new_tokens": 1, "temperature": 0})
    fresh_ids = engine.encode("Hello, how are you today?")
    fresh = engine.reqs.make(GenerateRequest(rid="fresh", input_ids=fresh_ids, sampling=PARAMS))
    cached_ids = [*shared, *engine.encode(" It lies")]
    cached = engine.reqs.make(GenerateRequest(rid="cached", input_ids=cached_ids, sampling=PARAMS))
    scheduler = engine.scheduler
    scheduler.add_request(fresh)  # arrives first
    scheduler.add_request(cached)
    admitted = [out.rid for out in scheduler.step() if out.new_token_ids]
    assert admitted == [first]
    while scheduler.has_work():
        scheduler.step()
    assert cached.cached_tokens >= len(shared) - 1 and fresh.cached_tokens == 0
    assert engine.is_memory_free()
    del engine, scheduler
    gc.collect()


def test_lpm_serves_a_starved_request_first(queue):
    """Requests past LPM_MAX_WAIT_S go ahead of cache hits, oldest first: a stream of
    requests that hit the cache cannot keep one that does not waiting for ever."""
    waiting, cache = queue
    now = waiting[0].created_at
    assert _order("lpm", waiting, cache, now)[-2:] == ["none", "other-ns"]
    later = now + LPM_MAX_WAIT_S + 1
    for req in waiting[2:]:  # long, medium and other-ns arrived just now
        req.created_at = later - 0.5
    waiting[1].created_at = now + 0.5  # short: starved too, after none
    assert _order("lpm", waiting, cache, later) == ["none", "short", "long", "medium", "other-ns"]
    waiting[3].retractions = 1  # retracted still goes first
    assert _order("lpm", waiting, cache, later)[0] == "medium"
