"""A transfer plan's pieces as gathers and scatters per buffer pair (the cuda_ipc
transport's copy): the same bytes land as one copy per piece would put there."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import kv_pool, model_config

from kvflow.runtime.disagg import TransferError, Write, layout_of, transfer_plan
from kvflow.runtime.disagg.transport.piece_copy import (
    Buffers,
    _runs_on,
    copy_pieces,
    unit_indices,
)

CONFIG = model_config()


def _bytes(pool) -> Buffers:
    layout = layout_of(pool, CONFIG, 1)
    buffers = [b for pair in zip(pool.k_buffer, pool.v_buffer, strict=True) for b in pair]
    return Buffers(
        tuple(r.ptr for r in layout.regions()), tuple(b.view(-1).view(torch.uint8) for b in buffers)
    )


def _one_by_one(writes, src: Buffers, dst: Buffers) -> None:
    """The reference: each piece copied on its own."""
    for w in writes:
        i = max((a, k) for k, a in enumerate(src.addrs) if a <= w.src_ptr)[1]
        j = max((a, k) for k, a in enumerate(dst.addrs) if a <= w.dst_ptr)[1]
        s, d = w.src_ptr - src.addrs[i], w.dst_ptr - dst.addrs[j]
        dst.tensors[j][d : d + w.nbytes] = src.tensors[i][s : s + w.nbytes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scattered_runs_land_as_one_copy_per_piece_would(dtype) -> None:
    torch.manual_seed(0)
    src_pool, got_pool, want_pool = (kv_pool(CONFIG, 64, dtype) for _ in range(3))
    for buf in (*src_pool.k_buffer, *src_pool.v_buffer):
        buf.copy_(torch.randn(buf.shape))
    src_slots = [*range(3, 20), 40, 41, 7 + 50, 9 + 50, 2]
    dst_slots = [*range(30, 47), 0, 1, 63, 5, 60]
    src = layout_of(src_pool, CONFIG, 1)
    plan = transfer_plan(src, layout_of(got_pool, CONFIG, 1), src_slots, dst_slots)
    reference = transfer_plan(src, layout_of(want_pool, CONFIG, 1), src_slots, dst_slots)
    copied = copy_pieces(plan, _bytes(src_pool), _bytes(got_pool))
    _one_by_one(reference, _bytes(src_pool), _bytes(want_pool))
    assert copied == sum(w.nbytes for w in plan)
    for got, ref in zip(_bytes(got_pool).tensors, _bytes(want_pool).tensors, strict=True):
        assert torch.equal(got, ref)


def test_units_are_the_largest_common_size_per_pair() -> None:
    """Two pieces of 2 and 3 slots of 8 bytes: units of 8 bytes; offsets become rows."""
    writes = [Write(1000 + 16, 5000 + 8, 16), Write(1000 + 48, 5000 + 40, 24)]
    (pair,) = unit_indices(writes, [1000], [256], [5000], [256])
    assert (pair.src, pair.dst, pair.unit) == (0, 0, 8)
    src_rows, dst_rows = pair.units()
    assert src_rows.tolist() == [2, 3, 6, 7, 8]
    assert dst_rows.tolist() == [1, 2, 5, 6, 7]
    runs = _runs_on([pair, pair], torch.device("cpu"))  # what copy_pieces sends
    assert runs.tolist() == [[2, 6, 2, 6], [1, 5, 1, 5], [2, 3, 2, 3]]


@pytest.mark.parametrize(
    "write, side",
    [
        (Write(1000 + 250, 5000, 8), "source"),  # runs past the source buffer's end
        (Write(1000, 4000, 8), "destination"),  # before every destination buffer
        (Write(1000, 5000 + 255, 2), "destination"),
    ],
)
def test_a_piece_outside_the_buffers_is_refused(write, side) -> None:
    with pytest.raises(TransferError, match=f"outside every {side} buffer"):
        unit_indices([write], [1000], [256], [5000], [256])
