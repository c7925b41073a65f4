"""transfer_plan: applied with memmove between two real KV pools, it reproduces the source."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import kv_pool, model_config

from kvflow.runtime.disagg import Write, layout_of, transfer_plan
from kvflow.runtime.mem import KVPool

CONFIG = model_config(num_hidden_layers=3)  # SmolLM2's heads, fewer layers: faster
SRC_SLOTS, DST_SLOTS = 40, 56


def pools(dtype: torch.dtype) -> tuple[KVPool, KVPool]:
    src, dst = kv_pool(CONFIG, SRC_SLOTS, dtype), kv_pool(CONFIG, DST_SLOTS, dtype)
    for buf in (*src.k_buffer, *src.v_buffer):
        buf.copy_(torch.randn(buf.shape))
    return src, dst


def raw(buf: torch.Tensor) -> np.ndarray:
    """The buffer's bytes, ``[slots, kv_heads, head_dim * itemsize]`` (numpy: no OpenMP
    pool, whose spinning threads made indexing take 0.5 s on a busy 2-core machine)."""
    return buf.view(torch.uint8).numpy()


def apply(writes: list[Write]) -> None:
    for w in writes:
        ctypes.memmove(w.dst_ptr, w.src_ptr, w.nbytes)


@st.composite
def slot_pairs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Unique source and destination slots, often with consecutive runs on both sides."""
    n = draw(st.integers(0, SRC_SLOTS))
    src = draw(st.permutations(range(SRC_SLOTS)))[:n]
    dst = draw(st.permutations(range(DST_SLOTS)))[:n]
    if draw(st.booleans()):  # sort both: long runs that coalesce
        src, dst = sorted(src), sorted(dst)
    return src, dst


@settings(max_examples=60, deadline=None, derandomize=True)
@given(pairs=slot_pairs(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_plan_reproduces_source_kv_at_destination(pairs, dtype) -> None:
    src_slots, dst_slots = pairs
    src, dst = pools(dtype)
    apply(transfer_plan(layout_of(src, CONFIG, 1), layout_of(dst, CONFIG, 1), src_slots, dst_slots))
    untouched = sorted(set(range(DST_SLOTS)) - set(dst_slots))
    for layer in range(CONFIG.num_layers):
        for src_buf, dst_buf in (
            (src.k_buffer[layer], dst.k_buffer[layer]),
            (src.v_buffer[layer], dst.v_buffer[layer]),
        ):
            assert np.array_equal(raw(dst_buf)[dst_slots], raw(src_buf)[src_slots])
            assert not raw(dst_buf)[untouched].any()


def test_runs_consecutive_on_both_sides_coalesce() -> None:
    src, dst = pools(torch.float32)
    src_layout, dst_layout = layout_of(src, CONFIG, 1), layout_of(dst, CONFIG, 1)
    per_buffer = 2 * CONFIG.num_layers
    contiguous = transfer_plan(src_layout, dst_layout, range(10, 30), range(1, 21))
    assert len(contiguous) == per_buffer
    assert contiguous[0] == Write(
        src_layout.k_addrs[0] + 10 * src_layout.slot_bytes,
        dst_layout.k_addrs[0] + 1 * dst_layout.slot_bytes,
        20 * src_layout.slot_bytes,
    )
    # source consecutive, destination broken once -> two runs
    assert (
        len(transfer_plan(src_layout, dst_layout, [1, 2, 3, 4], [7, 8, 20, 21])) == 2 * per_buffer
    )
    # destination consecutive, source reversed -> every slot is its own run
    assert len(transfer_plan(src_layout, dst_layout, [4, 3, 2], [1, 2, 3])) == 3 * per_buffer
    assert transfer_plan(src_layout, dst_layout, [], []) == []


def test_plan_refuses_bad_input() -> None:
    src, dst = pools(torch.float32)
    src_layout, dst_layout = layout_of(src, CONFIG, 1), layout_of(dst, CONFIG, 1)
    with pytest.raises(ValueError, match="3 source slots but 2"):
        transfer_plan(src_layout, dst_layout, [1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match=r"source slots \[40\] out of range \[0, 40\)"):
        transfer_plan(src_layout, dst_layout, [40], [1])
    with pytest.raises(ValueError, match="destination slots"):
        transfer_plan(src_layout, dst_layout, [1], [-1])
    other = kv_pool(CONFIG, DST_SLOTS, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype differs"):
        transfer_plan(src_layout, layout_of(other, CONFIG, 1), [1], [1])
