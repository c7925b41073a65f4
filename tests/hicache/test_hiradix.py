"""HiRadixCache: device evictions spill to host, host hits load back bit-exact, host LRU,
write policies, and every slot (device and host) comes back when the tree is emptied."""

from __future__ import annotations

import pytest
import torch

from kvflow.runtime.cache.hiradix import HiRadixCache, HiTreeNode
from kvflow.runtime.mem import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from kvflow.runtime.mem.host_pool import HostKVPool

LAYERS, HEADS, DIM = 2, 2, 4


def make_cache(
    device_pages: int = 8, host_pages: int = 16, page_size: int = 2, policy: str = "write_through"
) -> HiRadixCache:
    allocator = TokenToKVPoolAllocator(device_pages, page_size, "cpu")
    pool = KVPool((device_pages + 1) * page_size, LAYERS, HEADS, DIM, torch.float32, "cpu")
    host = HostKVPool(pool, page_size, host_pages)
    return HiRadixCache(ReqToTokenPool(4, 64, "cpu"), allocator, pool, host, policy)


def fill(cache: HiRadixCache, tokens: list[int]) -> torch.Tensor:
    """Allocate device slots for ``tokens``, write recognisable KV there, insert them."""
    slots = cache.allocator.alloc_for_request(0, 0, len(tokens))
    if slots is None:
        cache.evict(len(tokens) - cache.allocator.available_size())
        slots = cache.allocator.alloc_for_request(0, 0, len(tokens))
    assert slots is not None
    loc = torch.tensor(slots)
    pool = cache.copier.device
    for layer in range(LAYERS):
        value = torch.tensor(tokens, dtype=torch.float32)[:, None, None] * (layer + 1)
        pool.k_buffer[layer][loc] = value.expand(-1, HEADS, DIM) + 0.25
        pool.v_buffer[layer][loc] = value.expand(-1, HEADS, DIM) - 0.5
    already = cache.insert(tokens, loc)
    if already:
        cache.allocator.free(loc[:already])
    return loc


def kv_at(cache: HiRadixCache, slots: torch.Tensor) -> torch.Tensor:
    pool = cache.copier.device
    return torch.stack(
        [torch.stack([pool.k_buffer[i][slots], pool.v_buffer[i][slots]]) for i in range(LAYERS)]
    )


def expected_kv(tokens: list[int]) -> torch.Tensor:
    rows = []
    for layer in range(LAYERS):
        value = torch.tensor(tokens, dtype=torch.float32)[:, None, None] * (layer + 1)
        value = value.expand(-1, HEADS, DIM)
        rows.append(torch.stack([value + 0.25, value - 0.5]))
    return torch.stack(rows)


def all_free(cache: HiRadixCache) -> bool:
    return (
        cache.allocator.available_size() == cache.allocator.size
        and cache.host.allocator.available_size() == cache.host.allocator.size
    )


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evicted_prefix_is_found_on_host_and_loads_back_bit_exact(policy):
    cache = make_cache(policy=policy)
    tokens = list(range(1, 9))  # 4 pages
    fill(cache, tokens)
    assert cache.evict(cache.total_size()) == 8
    assert cache.total_size() == 0 and cache.allocator.available_size() == cache.allocator.size
    match = cache.match_prefix([*tokens, 99])
    assert match.kv_indices.numel() == 0 and match.host_hit_len == 8
    # reuse the device memory for something else, so the load-back lands elsewhere
    fill(cache, [50, 51, 52, 53])
    loaded = cache.load_back(match)
    assert loaded.host_hit_len == 0 and len(loaded.kv_indices) == 8
    assert torch.equal(kv_at(cache, loaded.kv_indices), expected_kv(tokens))
    assert cache.counters.host_hit_tokens == 8
    again = cache.match_prefix(tokens)
    assert again.kv_indices.tolist() == loaded.kv_indices.tolist() and again.host_hit_len == 0


def test_write_through_backs_up_on_insert_and_write_back_on_eviction():
    through = make_cache(policy="write_through")
    fill(through, [1, 2, 3, 4])
    assert through.host_used_size() == 4 and through.counters.backed_up_tokens == 4
    back = make_cache(policy="write_back")
    fill(back, [1, 2, 3, 4])
    assert back.host_used_size() == 0
    back.evict(4)
    assert back.host_used_size() == 4 and back.counters.backed_up_tokens == 4


def test_partial_host_hit_after_device_prefix():
    cache = make_cache()
    fill(cache, [1, 2, 3, 4, 5, 6])
    node = cache.match_prefix([1, 2]).last_node  # split at one page
    cache.inc_lock_ref(node)
    cache.evict(100)  # only the unlocked tail [3..6] leaves the device
    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert len(match.kv_indices) == 2 and match.host_hit_len == 4
    loaded = cache.load_back(match)
    assert len(loaded.kv_indices) == 6
    assert torch.equal(kv_at(cache, loaded.kv_indices), expected_kv([1, 2, 3, 4, 5, 6]))
    cache.dec_lock_ref(node)


def test_host_pool_evicts_least_recently_used_host_only_nodes():
    cache = make_cache(device_pages=4, host_pages=4, page_size=2)  # host holds 8 tokens
    fill(cache, [1, 2, 3, 4])
    cache.evict(100)
    fill(cache, [5, 6, 7, 8])
    cache.evict(100)
    cache.match_prefix([5, 6, 7, 8])  # touch: [1..4] is now the least recently used
    fill(cache, [9, 10, 11, 12])  # its backup needs host room: [1..4] goes
    assert cache.match_prefix([1, 2, 3, 4]).host_hit_len == 0
    assert cache.match_prefix([5, 6, 7, 8]).host_hit_len == 4
    assert cache.counters.host_evicted_tokens == 4


def test_device_eviction_without_host_room_drops_the_node_and_its_subtree():
    cache = make_cache(device_pages=4, host_pages=1, page_size=2, policy="write_back")
    fill(cache, [1, 2, 3, 4, 5, 6])  # 3 pages; host has room for 1
    freed = cache.evict(100)
    assert freed == 6 and cache.counters.dropped_tokens >= 4
    match = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert match.kv_indices.numel() == 0
    cache.evict(100)
    cache.reset()
    assert all_free(cache)


def test_insert_over_a_host_only_node_adopts_the_new_device_kv():
    cache = make_cache()
    fill(cache, [1, 2, 3, 4])
    cache.evict(100)
    loc = fill(cache, [1, 2, 3, 4, 5, 6])  # recomputed instead of loaded back
    match = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert match.kv_indices.tolist() == loc.tolist() and match.host_hit_len == 0
    assert cache.total_size() == 6


def test_load_back_without_device_room_leaves_the_match_as_is():
    cache = make_cache(device_pages=2, host_pages=8, page_size=2)
    fill(cache, [1, 2, 3, 4])
    cache.evict(100)
    other = fill(cache, [7, 8, 9, 10])
    node = cache.match_prefix([7, 8, 9, 10]).last_node
    cache.inc_lock_ref(node)  # the device is full and locked
    match = cache.match_prefix([1, 2, 3, 4])
    assert cache.load_back(match).host_hit_len == 4
    cache.dec_lock_ref(node)
    assert other.numel() == 4


def test_every_slot_comes_back_after_churn():
    cache = make_cache(device_pages=6, host_pages=10, page_size=2)
    prompts = [[i, i + 1, i + 2, i + 3, (i * 7) % 13, 40 + i] for i in range(0, 40, 3)]
    for prompt in prompts:
        fill(cache, prompt)
        match = cache.match_prefix(prompts[0])
        cache.inc_lock_ref(cache.load_back(match).last_node)
        cache.dec_lock_ref(cache.match_prefix(prompts[0]).last_node)
        for n in cache._nodes():  # every node holds its KV somewhere; device is ancestor-closed
            assert isinstance(n, HiTreeNode) and (n.value is not None or n.host_value is not None)
            if n.value is not None and n.parent is not None and n.parent.parent is not None:
                assert n.parent.value is not None
    cache.evict(cache.total_size())
    cache.reset()
    assert all_free(cache)
