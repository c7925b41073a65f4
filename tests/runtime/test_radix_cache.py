"""RadixCache: matching, node splitting, lock references, LRU eviction order, namespaces."""

from __future__ import annotations

import torch

from kvflow.runtime.cache import RadixCache
from kvflow.runtime.mem import ReqToTokenPool, TokenToKVPoolAllocator


def make_cache(page_size: int = 1, pages: int = 64) -> RadixCache:
    allocator = TokenToKVPoolAllocator(pages, page_size, "cpu")
    return RadixCache(ReqToTokenPool(4, 64, "cpu"), allocator)


def insert(cache: RadixCache, tokens: list[int], extra_key: str | None = None) -> torch.Tensor:
    allocated = cache.allocator.alloc_for_request(0, 0, len(tokens))
    assert allocated is not None
    slots = torch.tensor(allocated)
    already = cache.insert(tokens, slots, extra_key)
    cache.allocator.free(slots[:already]) if already else None
    return slots


def test_match_and_split():
    cache = make_cache()
    slots = insert(cache, [1, 2, 3, 4, 5])
    match = cache.match_prefix([1, 2, 3, 9])
    assert match.kv_indices.tolist() == slots[:3].tolist()
    # the edge [1..5] was split at 3: the matched node ends exactly at token 3
    assert match.last_node.key == [1, 2, 3]
    assert next(iter(match.last_node.children.values())).key == [4, 5]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).kv_indices.tolist() == slots.tolist()
    assert cache.match_prefix([7]).kv_indices.numel() == 0
    assert cache.total_size() == 5


def test_insert_reports_already_cached_prefix():
    cache = make_cache()
    insert(cache, [1, 2, 3])
    slots = torch.tensor(cache.allocator.alloc_for_request(0, 0, 5))
    assert cache.insert([1, 2, 3, 4, 5], slots) == 3
    cache.allocator.free(slots[:3])
    assert cache.total_size() == 5


def test_locked_nodes_are_not_evicted():
    cache = make_cache()
    insert(cache, [1, 2, 3])
    insert(cache, [4, 5])
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(node)
    assert cache.evictable_size() == 2 and cache.protected_size() == 3
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3]).kv_indices.numel() == 3
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 3
    assert cache.allocator.available_size() == cache.allocator.size


def test_lock_protects_ancestors():
    cache = make_cache()
    insert(cache, [1, 2, 3, 4])
    insert(cache, [1, 2, 7])  # splits: [1,2] -> {[3,4], [7]}
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(leaf)
    cache.evict(100)
    assert cache.match_prefix([1, 2, 3, 4]).kv_indices.numel() == 4
    assert cache.match_prefix([1, 2, 7]).kv_indices.numel() == 2  # [7] evicted, [1,2] kept
    cache.dec_lock_ref(leaf)


def test_eviction_is_least_recently_used_first():
    cache = make_cache()
    for first in (10, 20, 30):
        insert(cache, [first, first + 1])
    cache.match_prefix([10, 11])  # touch: 10 is now the most recent
    assert cache.evict(2) == 2
    assert cache.match_prefix([20, 21]).kv_indices.numel() == 0  # oldest went first
    assert cache.match_prefix([10, 11]).kv_indices.numel() == 2
    assert cache.match_prefix([30, 31]).kv_indices.numel() == 2
    cache.evict(1)  # the two checks above touched 10 then 30: 10 is now the oldest
    assert cache.match_prefix([30, 31]).kv_indices.numel() == 2
    assert cache.match_prefix([10, 11]).kv_indices.numel() == 0


def test_parent_becomes_evictable_after_its_children():
    cache = make_cache()
    insert(cache, [1, 2, 3])
    insert(cache, [1, 2, 4])
    assert cache.evict(100) == 4
    assert cache.total_size() == 0


def test_extra_keys_are_separate_namespaces():
    cache = make_cache()
    insert(cache, [1, 2, 3], extra_key="adapter-a")
    assert cache.match_prefix([1, 2, 3]).kv_indices.numel() == 0
    assert cache.match_prefix([1, 2, 3], "adapter-b").kv_indices.numel() == 0
    assert cache.match_prefix([1, 2, 3], "adapter-a").kv_indices.numel() == 3


def test_paged_matching_is_page_aligned():
    cache = make_cache(page_size=4)
    insert(cache, list(range(10)))  # only the first 8 tokens (2 pages) are inserted
    assert cache.total_size() == 8
    assert cache.match_prefix(list(range(7))).kv_indices.numel() == 4
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 9, 9]).kv_indices.numel() == 4
    assert cache.match_prefix(list(range(12))).kv_indices.numel() == 8
