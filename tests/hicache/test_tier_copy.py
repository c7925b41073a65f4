"""The tier copies' page bookkeeping: runs of consecutive host pages (one DMA each on
CUDA) cover every page once, in order; on CPU a page survives device -> host -> device
bit for bit (the CUDA path: tests/gpu/test_gpu_hicache.py)."""

from __future__ import annotations

import itertools
import random

import torch

from kvflow.runtime.cache.tier_copy import TierCopy, page_runs
from kvflow.runtime.mem import KVPool
from kvflow.runtime.mem.host_pool import HostKVPool


def test_page_runs_cover_every_page_once_in_order():
    assert page_runs([]) == []
    assert page_runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    rng = random.Random(0)
    for _ in range(200):
        pages = rng.sample(range(64), rng.randrange(1, 40))
        if rng.random() < 0.5:
            pages.sort()
        runs = page_runs(pages)
        rebuilt = [p for _, first, count in runs for p in range(first, first + count)]
        assert rebuilt == pages
        assert [at for at, _, _ in runs] == [
            sum(c for _, _, c in runs[:i]) for i in range(len(runs))
        ]
        # runs are maximal: a run never continues where the next one starts
        assert all(a[1] + a[2] != b[1] for a, b in itertools.pairwise(runs))


def test_pages_survive_a_round_trip_through_the_host_pool():
    page, pages = 4, 16
    pool = KVPool((pages + 1) * page, 3, 2, 8, torch.float32, "cpu")
    for buf in pool.k_buffer + pool.v_buffer:
        buf.normal_()
    copier = TierCopy(pool, HostKVPool(pool, page, 8))
    dev = torch.tensor([p * page + i for p in (3, 7, 4) for i in range(page)])
    hst = torch.tensor([p * page + i for p in (5, 6, 1) for i in range(page)])
    expected = [b[dev].clone() for b in pool.k_buffer + pool.v_buffer]
    assert copier.to_host(dev, hst).done()
    back = torch.tensor([p * page + i for p in (10, 11, 12) for i in range(page)])
    assert copier.to_device(hst, back).done()
    for want, buf in zip(expected, pool.k_buffer + pool.v_buffer, strict=True):
        assert torch.equal(buf[back], want)
