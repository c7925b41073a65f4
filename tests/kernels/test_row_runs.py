"""copy_row_runs (a KV plan's pages in one pass) against one copy per run."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import device_for

from kvflow.kernels.row_runs import copy_row_runs, copy_row_runs_ref, copy_slot_runs


def _check(device: str, width: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(width)
    src = torch.randint(-(2**15), 2**15, (300, width), generator=gen).to(dtype)
    # pages of 16, a long contiguous run, single rows and a ragged tail
    runs = [(0, 100, 16), (16, 40, 16), (32, 200, 70), (120, 7, 1), (150, 290, 9), (299, 0, 1)]
    src_starts, dst_starts, counts = (
        torch.tensor(c, dtype=torch.int64) for c in zip(*runs, strict=True)
    )
    want = torch.zeros_like(src)
    copy_row_runs_ref(src, want, src_starts, dst_starts, counts, 70)
    got = torch.zeros_like(src).to(device)
    on = [t.to(device) for t in (src_starts, dst_starts, counts)]
    copy_row_runs(src.to(device), got, *on, longest=70)
    assert torch.equal(got.cpu(), want)
    assert want.any()


@pytest.mark.interpret
@pytest.mark.parametrize(("width", "dtype"), [(256, torch.int64), (3, torch.int16)])
def test_copy_row_runs_interpret(width, dtype):
    _check(device_for("interpret"), width, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("width", "dtype"), [(256, torch.int64), (600, torch.int32), (3, torch.int16)]
)
def test_copy_row_runs_gpu(width, dtype):
    _check(device_for("gpu"), width, dtype)


def _check_slots(device: str, row_bytes: int, word: int) -> None:
    """Three buffer pairs (K and V of a few layers) of different sizes, the same runs."""
    gen = torch.Generator().manual_seed(row_bytes)
    sources = [torch.randint(0, 256, (n * row_bytes,), generator=gen, dtype=torch.uint8)
               for n in (40, 50, 45)]  # fmt: skip
    runs = [(0, 30, 16), (20, 3, 5), (39, 0, 1), (16, 10, 3)]
    want = [torch.zeros(60 * row_bytes, dtype=torch.uint8) for _ in sources]
    for src, dst in zip(sources, want, strict=True):
        for s, d, n in runs:
            dst[d * row_bytes : (d + n) * row_bytes] = src[s * row_bytes : (s + n) * row_bytes]
    sources = [s.to(device) for s in sources]
    got = [torch.zeros_like(w).to(device) for w in want]
    starts = [c for column in zip(*runs, strict=True) for c in column]
    table = torch.tensor(
        [t.data_ptr() for t in sources] + [t.data_ptr() for t in got] + starts, dtype=torch.int64
    ).to(device)
    copy_slot_runs(table, len(sources), row_bytes, longest=16, word=word)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)


@pytest.mark.interpret
@pytest.mark.parametrize(("row_bytes", "word"), [(256, 8), (6, 2)])
def test_copy_slot_runs_interpret(row_bytes, word):
    _check_slots(device_for("interpret"), row_bytes, word)


@pytest.mark.gpu
@pytest.mark.parametrize(("row_bytes", "word"), [(2048, 8), (1024, 8), (6, 2), (12, 1)])
def test_copy_slot_runs_gpu(row_bytes, word):
    _check_slots(device_for("gpu"), row_bytes, word)
