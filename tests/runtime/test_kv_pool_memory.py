"""The CPU KV pool commits memory as it is written: its size is not resident at start-up."""

from __future__ import annotations

import torch

from kvflow.runtime.mem import KVPool

PAGE = 4096


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def test_cpu_pool_is_resident_only_where_written():
    before = _resident_bytes()
    pool = KVPool(200_000, 30, 3, 64, torch.bfloat16, "cpu")  # 2.1 GiB of K and V
    size = 2 * 30 * 200_000 * 3 * 64 * 2
    assert _resident_bytes() - before < size // 50
    loc = torch.arange(1000, 1016)
    k = torch.randn(16, 3, 64).to(torch.bfloat16)
    pool.store(7, loc, k, -k)
    assert torch.equal(pool.k_buffer[7][loc], k) and torch.equal(pool.v_buffer[7][loc], -k)
    assert not pool.k_buffer[6].any() and not pool.v_buffer[29][:1000].any()  # zeroed
    assert pool.k_buffer[0].is_contiguous() and pool.k_buffer[0].shape == (200_000, 3, 64)
    assert _resident_bytes() - before < size // 50
