"""The native kernels' thread pool (``pool.c``): the same results whatever the thread count
(more threads than cores included, so workers are descheduled mid-loop), from several
Python threads at once (ctypes releases the GIL), and in a forked child."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator

import pytest
import torch

from kvflow.kernels.cpu import available, elementwise, gemm, paged_attention, pool

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler for the native kernels")

THREADS = [1, 2, 3, 8]


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    before = pool.get_num_threads()
    yield
    pool.set_num_threads(before)


def _under(threads: int, fn):
    pool.set_num_threads(threads)
    assert pool.get_num_threads() == threads
    return fn()


@pytest.mark.parametrize("rows", [1, 32, 300])  # 300: two row blocks of 256
def test_gemm_is_identical_for_every_thread_count(rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, gate_up = torch.randn(1000, 96, generator=gen), torch.randn(256, 96, generator=gen)
    bias = torch.randn(1000, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    plain, fused = gemm.pack(weight), gemm.pack(gate_up, silu_mul=True)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return gemm.gemm(x, plain, 1000, bias=bias), gemm.gemm(x, fused, 256, silu_mul=True)

    first = _under(1, run)
    torch.testing.assert_close(first[0], gemm.gemm_ref(x, weight, bias), atol=1e-4, rtol=1e-5)
    for threads in THREADS[1:]:
        got = _under(threads, run)
        assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1]), threads


def test_row_wise_kernels_are_identical_for_every_thread_count() -> None:
    gen = torch.Generator().manual_seed(1)
    x, residual = torch.randn(700, 576, generator=gen), torch.randn(700, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    gate_up = torch.randn(700, 2 * 1536, generator=gen)

    def run() -> tuple[torch.Tensor, ...]:
        out, res = elementwise.rmsnorm(x, weight, 1e-5, residual=residual.clone())
        return out, res, elementwise.silu_and_mul(gate_up)

    first = _under(1, run)
    for threads in THREADS[1:]:
        for got, want in zip(_under(threads, run), first, strict=True):
            assert torch.equal(got, want), threads


def _attention_case(lens: list[int], extend: int = 0):
    gen = torch.Generator().manual_seed(len(lens))
    k_buf, v_buf = torch.randn(2, 4096, 3, 64, generator=gen)
    table = torch.randperm(4096, generator=gen)[: 4 * 1024].view(4, 1024).to(torch.int32)
    rows = [i % 4 for i in range(len(lens))] + [3] * extend
    visible = lens + [lens[-1] + j + 1 for j in range(extend)] if extend else lens
    q = torch.randn(len(rows), 9, 64, generator=gen)
    return q, k_buf, v_buf, table, torch.tensor(rows), torch.tensor(visible)


@pytest.mark.parametrize("extend", [0, 40], ids=["decode", "extend"])
def test_attention_is_identical_for_every_thread_count(extend) -> None:
    # 5 rows: one work item per (row, KV head) at 2 threads and more, as at 8
    args = _attention_case([1, 33, 100, 515, 900], extend)
    scale = 1 / math.sqrt(64)
    first = _under(2, lambda: paged_attention(*args, scale))
    for threads in (3, 8):
        assert torch.equal(_under(threads, lambda: paged_attention(*args, scale)), first)


def test_concurrent_callers_get_their_own_results() -> None:
    pool.set_num_threads(2)
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(512, 64, generator=gen) for _ in range(4)]
    packed = [gemm.pack(w) for w in weights]
    xs = [torch.randn(16, 64, generator=gen) for _ in range(4)]
    wants = [gemm.gemm(x, p, 512) for x, p in zip(xs, packed, strict=True)]
    errors: list[str] = []

    def caller(i: int) -> None:
        for _ in range(200):
            if not torch.equal(gemm.gemm(xs[i], packed[i], 512), wants[i]):
                errors.append(f"caller {i}")
                return

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors


def test_a_forked_child_runs_loops_on_fresh_workers() -> None:
    pool.set_num_threads(2)
    x, weight = torch.randn(8, 64), torch.randn(256, 64)
    packed = gemm.pack(weight)
    want = gemm.gemm(x, packed, 256)  # the parent's workers exist now
    pid = os.fork()
    if pid == 0:  # the child: no workers until its first loop creates them
        ok = all(torch.equal(gemm.gemm(x, packed, 256), want) for _ in range(50))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
