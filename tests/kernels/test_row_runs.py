"""copy_row_runs (a KV plan's pages in one pass) against one copy per run."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import device_for

from kvflow.kernels.row_runs import copy_row_runs, copy_row_runs_ref


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
