"""Routing policies and the prefix tree, without processes."""

from __future__ import annotations

import random

import pytest

from kvflow.runtime.router import POLICIES, BreakerConfig, CacheAwareConfig, RouterConfig
from kvflow.runtime.router.breaker import CircuitBreaker
from kvflow.runtime.router.discovery import WorkerSpec
from kvflow.runtime.router.pd import least_loaded, pd_body
from kvflow.runtime.router.policies import PrefixTree
from kvflow.runtime.router.policies.cache_aware import CacheAwarePolicy
from kvflow.runtime.router.prompt import routing_key
from kvflow.runtime.router.worker import Worker

pytestmark = pytest.mark.timeout(60)


def make(
    url: str, in_flight: int = 0, role: str = "unified", bootstrap: int | None = None
) -> Worker:
    worker = Worker(WorkerSpec(url, role, bootstrap), CircuitBreaker(BreakerConfig()))
    worker.in_flight = in_flight
    return worker


def test_prefix_tree_matches_longest_prefix_and_splits_edges():
    tree = PrefixTree(max_size=1000)
    tree.insert("hello world")
    tree.insert("hello there")
    assert tree.match("hello world!").matched == 11
    assert tree.match("hello th").matched == 8
    assert tree.match("help").matched == 3
    assert tree.match("xyz").matched == 0
    assert tree.size == len("hello ") + len("world") + len("there")
    assert tree.match("hello").ratio == 1.0


def _common_prefix(a: str, b: str) -> int:
    """The reference: compare character by character."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("seed", range(20))
def test_prefix_tree_match_is_the_longest_common_prefix_with_any_inserted_key(seed):
    # Small alphabets make long shared runs and splits at every depth; token-id keys use
    # characters past the BMP (see prompt.py).
    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc\x00\U000f0001\U0010fffd"
    tree, inserted = PrefixTree(max_size=10**6), [""]
    for _ in range(300):
        key = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        expected = max(_common_prefix(key, k) for k in inserted)
        assert tree.match(key).matched == expected, (key, inserted)
        if rng.random() < 0.5:
            tree.insert(key)
            inserted.append(key)
    assert tree.size <= sum(len(k) for k in inserted)


def test_prefix_tree_evicts_least_recently_used_leaves_within_bound():
    tree = PrefixTree(max_size=100)
    tree.insert("a" * 40)
    tree.insert("b" * 40)
    tree.match("a" * 40)  # "a..." is now more recent than "b..."
    tree.insert("c" * 40)  # 120 > 100: evict down to 90, oldest leaf first
    assert tree.size <= 100
    assert tree.match("b" * 40).matched == 0
    assert tree.match("a" * 40).matched == 40
    assert tree.match("c" * 40).matched == 40


def test_prefix_tree_eviction_climbs_to_parents_left_childless():
    tree = PrefixTree(max_size=30)
    tree.insert("shared-" + "x" * 10)
    tree.insert("shared-" + "y" * 10)
    for i in range(10):
        tree.insert(f"{i}" * 25)
    assert tree.size <= 30
    assert tree.match("shared-").matched == 0


def test_round_robin_cycles():
    workers = [make("http://a:1"), make("http://b:1"), make("http://c:1")]
    policy = POLICIES.get("round_robin")(RouterConfig())
    chosen = [policy.select(workers, "").worker.url for _ in range(6)]
    assert chosen == ["http://a:1", "http://b:1", "http://c:1"] * 2


def test_power_of_two_prefers_the_less_loaded_of_two():
    busy, idle = make("http://a:1", in_flight=10), make("http://b:1", in_flight=0)
    policy = POLICIES.get("power_of_two")(RouterConfig())
    assert {policy.select([busy, idle], "").worker.url for _ in range(20)} == {"http://b:1"}


def test_reported_load_refines_the_routers_own_count():
    worker = make("http://a:1", in_flight=2)
    worker.report_load(7)  # 5 requests the router did not send (another router, say)
    assert worker.load == 7
    worker.in_flight = 0
    assert worker.load == 5


def test_cache_aware_follows_the_prefix_and_learns():
    a, b = make("http://a:1"), make("http://b:1")
    policy = CacheAwarePolicy(CacheAwareConfig(cache_threshold=0.5))
    system = "You are a pirate. " * 10
    first = policy.select([a, b], system + "Question one?").worker
    for q in ("two", "three", "four"):
        selection = policy.select([a, b], system + f"Question {q}?")
        assert selection.worker is first
        assert selection.match_ratio is not None and selection.match_ratio > 0.5
    # an unrelated prompt goes to the worker with the smaller tree: the other one
    assert policy.select([a, b], "Completely different text").worker is not first


def test_cache_aware_yields_to_imbalance():
    a, b = make("http://a:1"), make("http://b:1")
    policy = CacheAwarePolicy(
        CacheAwareConfig(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    )
    prompt = "shared prefix " * 20
    owner = policy.select([a, b], prompt).worker
    other = b if owner is a else a
    owner.in_flight = 10  # 10 - 0 > 4 and 10 > 0 * 1.5: imbalanced
    selection = policy.select([a, b], prompt)
    assert selection.worker is other and selection.match_ratio is None
    owner.in_flight = 3  # within the absolute bound: cache wins again
    assert policy.select([a, b], prompt).worker is owner


def test_cache_aware_forgets_removed_workers():
    a = make("http://a:1")
    policy = CacheAwarePolicy(CacheAwareConfig())
    policy.select([a], "some prompt")
    assert "http://a:1" in policy.trees
    policy.forget("http://a:1")
    assert "http://a:1" not in policy.trees


def test_routing_keys():
    chat = {
        "messages": [
            {"role": "system", "content": "Sys. "},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
        ]
    }
    assert routing_key("/v1/chat/completions", chat) == "Sys. Hi"
    assert routing_key("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    ids = routing_key("/generate", {"input_ids": [1, 2, 3]})
    assert len(ids) == 4 and ids.startswith("\x00")
    assert routing_key("/generate", {"input_ids": [1, 2, 4]})[:3] == ids[:3]
    assert routing_key("/v1/completions", {"prompt": [[5, 6], [7]]}) == routing_key(
        "/generate", {"input_ids": [5, 6]}
    )
    assert routing_key("/v1/chat/completions", {"messages": "nope"}) == ""


def test_pd_body_adds_sglang_bootstrap_fields():
    import json

    prefill = make("http://10.0.0.7:8000", role="prefill", bootstrap=9001)
    body = json.loads(
        pd_body("/v1/chat/completions", {"messages": []}, prefill, 8998, rng=random.Random(1))
    )
    assert body["bootstrap_host"] == "10.0.0.7" and body["bootstrap_port"] == 9001
    assert 0 <= body["bootstrap_room"] < 2**63
    no_port = make("http://h:1", role="prefill")
    batch = json.loads(pd_body("/generate", {"text": ["a", "b"]}, no_port, 8998))
    assert batch["bootstrap_port"] == [8998, 8998] and len(set(batch["bootstrap_room"])) == 2
    decodes = [make("http://d1:1", 3, "decode"), make("http://d2:1", 1, "decode")]
    assert least_loaded(decodes).url == "http://d2:1"


def test_pd_body_signs_each_pair_and_drops_a_clients_token():
    import json

    from kvflow.runtime.wire import Bootstrap
    from kvflow.runtime.wire.pair_token import PairTrust

    prefill = make("http://10.0.0.7:8000", role="prefill", bootstrap=9001)
    forged = {"messages": [], "bootstrap_token": "v1.9999999999.00"}
    unsigned = json.loads(pd_body("/v1/chat/completions", forged, prefill, 8998))
    assert "bootstrap_token" not in unsigned
    body = json.loads(pd_body("/v1/chat/completions", forged, prefill, 8998, "k1"))
    pair = Bootstrap(body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"])
    assert PairTrust(key="k1").problem(pair, body["bootstrap_token"]) is None
    assert "does not match" in PairTrust(key="k2").problem(pair, body["bootstrap_token"])
    batch = json.loads(pd_body("/generate", {"text": ["a", "b"]}, prefill, 8998, "k1"))
    for room, token in zip(batch["bootstrap_room"], batch["bootstrap_token"], strict=True):
        assert PairTrust(key="k1").problem(Bootstrap("10.0.0.7", 9001, room), token) is None
