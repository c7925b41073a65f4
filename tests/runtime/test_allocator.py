"""The paged KV allocator and the request-slot pool: no leaks, page discipline, guards."""

from __future__ import annotations

import random

import pytest
import torch

from kvflow.runtime.mem import ReqToTokenPool, TokenToKVPoolAllocator


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_random_alloc_free_never_leaks(page_size):
    allocator = TokenToKVPoolAllocator(num_pages=64, page_size=page_size, device="cpu")
    rng = random.Random(0)
    live: list[tuple[int, torch.Tensor]] = []  # (length, slots) per fake request
    for _ in range(5000):
        if live and (rng.random() < 0.45 or allocator.available_size() < page_size):
            _, slots = live.pop(rng.randrange(len(live)))
            allocator.free(slots)
            continue
        if live and rng.random() < 0.5:  # grow an existing request
            i = rng.randrange(len(live))
            length, slots = live[i]
            grown = allocator.alloc_for_request(length, int(slots[-1]), rng.randint(1, 5))
            if grown is not None:
                live[i] = (length + len(grown), torch.cat([slots, torch.tensor(grown)]))
            continue
        n = rng.randint(1, 3 * page_size)
        slots = allocator.alloc_for_request(0, 0, n)
        if slots is not None:
            live.append((n, torch.tensor(slots)))
    all_slots = torch.cat([s for _, s in live]) if live else torch.empty(0, dtype=torch.int64)
    assert all_slots.unique().numel() == all_slots.numel(), "a slot was handed out twice"
    assert (all_slots >= page_size).all(), "page 0 (padding) was handed out"
    for _, slots in live:
        allocator.free(slots)
    assert allocator.available_size() == allocator.size


def test_request_fills_its_page_before_taking_another():
    allocator = TokenToKVPoolAllocator(num_pages=8, page_size=4, device="cpu")
    first = allocator.alloc_for_request(0, 0, 3)
    assert first is not None and len({slot // 4 for slot in first}) == 1
    more = allocator.alloc_for_request(3, first[-1], 2)
    assert more is not None
    assert more[0] == first[-1] + 1  # completes the page
    assert more[1] % 4 == 0  # then starts a fresh page
    assert allocator.available_size() == (8 - 2) * 4


@pytest.mark.parametrize("page_size", [1, 16])
def test_pages_freed_together_come_back_ascending(page_size):
    allocator = TokenToKVPoolAllocator(num_pages=64, page_size=page_size, device="cpu")
    first = allocator.alloc_for_request(0, 0, 20 * page_size)
    assert first == sorted(first)
    allocator.free(torch.tensor(first))
    again = allocator.alloc_for_request(0, 0, 20 * page_size)
    assert again == list(range(again[0], again[0] + len(again)))


def test_alloc_fails_cleanly_when_full():
    allocator = TokenToKVPoolAllocator(num_pages=2, page_size=2, device="cpu")
    assert allocator.alloc_for_request(0, 0, 5) is None
    assert allocator.available_size() == 4  # nothing taken by the failed call


def test_double_free_is_refused():
    allocator = TokenToKVPoolAllocator(num_pages=4, page_size=1, device="cpu")
    slots = torch.tensor(allocator.alloc_for_request(0, 0, 2))
    allocator.free(slots)
    with pytest.raises(RuntimeError):
        allocator.free(slots)


def test_req_to_token_rows():
    pool = ReqToTokenPool(size=3, max_context_len=8, device="cpu")
    rows = [pool.alloc() for _ in range(3)]
    assert pool.alloc() is None
    pool.write(rows[0], 2, torch.tensor([7, 8]))
    assert pool.read(rows[0], 4, 2).tolist() == [7, 8]
    pool.free(rows[0])
    with pytest.raises(RuntimeError):
        pool.free(rows[0])
    assert pool.available_size() == 1
