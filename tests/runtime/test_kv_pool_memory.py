"""The CPU KV pool commits memory as it is written: its size is not resident at start-up."""

from __future__ import annotations

import torch

from kvflow.runtime.mem import KVPool


def _mapping_resident_bytes(address: int) -> int:
    """Resident bytes of the mapping holding ``address`` (``/proc/self/smaps``): the pool's
    own pages, whatever the process's heap does meanwhile."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds address {address:#x}")


def test_cpu_pool_is_resident_only_where_written():
    pool = KVPool(200_000, 30, 3, 64, torch.bfloat16, "cpu")  # 2.1 GiB of K and V
    size = 2 * 30 * 200_000 * 3 * 64 * 2
    address = pool.k_buffer[0].data_ptr()
    assert _mapping_resident_bytes(address) < size // 50
    loc = torch.arange(1000, 1016)
    k = torch.randn(16, 3, 64).to(torch.bfloat16)
    pool.store(7, loc, k, -k)
    assert torch.equal(pool.k_buffer[7][loc], k) and torch.equal(pool.v_buffer[7][loc], -k)
    assert not pool.k_buffer[6].any() and not pool.v_buffer[29][:1000].any()  # zeroed
    assert pool.k_buffer[0].is_contiguous() and pool.k_buffer[0].shape == (200_000, 3, 64)
    # the two pages written are resident; reading the rest maps no memory of its own
    assert _mapping_resident_bytes(address) < size // 50
