"""Segmented LoRA shrink/expand against their torch references: segments of mixed lengths,
adapters in any slot order, base-model segments (slot -1) left untouched; the decode
graphs' grouped layout (rows permuted so each slot is one segment, empty segments, padding
rows in the base segment); adapters of mixed ranks in merged layers' shards, with the
weights past each rank and off B's diagonal poisoned (NaN) so that reading them shows; and
the per-segment loop of eager batches (library matmuls over each slot's whole width)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch
from kernel_testing import device_for, indptr

from kvflow.kernels import (
    lora_delta_masked,
    lora_delta_segments,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_dense,
    lora_shrink_ref,
)
from kvflow.runtime.lora.batch import row_mask
from kvflow.runtime.lora.weights import SlotWeights

_TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def _weights(gen, num_slots, width, k, shard_rows, ranks, poison):
    """Stacked ``A`` ``[slots, shards * width, K]`` and block-diagonal ``B`` ``[slots, N,
    shards * width]``: zeros (or NaN with ``poison``) past each slot's rank and off B's
    diagonal, as a LoRA layer's slots hold them."""
    shards = len(shard_rows)
    a = torch.randn(num_slots, shards * width, k, generator=gen) * k**-0.5
    b = torch.randn(num_slots, sum(shard_rows), shards * width, generator=gen) * width**-0.5
    fill = float("nan") if poison else 0.0
    first_row = 0
    for shard, rows in enumerate(shard_rows):
        cols = slice(shard * width, (shard + 1) * width)
        b[:, :first_row, cols] = fill
        b[:, first_row + rows :, cols] = fill
        first_row += rows
        for slot, rank in enumerate(ranks or [width] * num_slots):
            a[slot, shard * width + rank : (shard + 1) * width] = fill
            b[slot, :, shard * width + rank : (shard + 1) * width] = fill
    return a, b


def _check(
    device, dtype, lengths, slots, k, n, rank, num_slots=3, splits=None, *,
    permute=False, ranks: Sequence[int] | None = None, shard_rows=None, max_seg_len=None,
    poison=False, dense=False,
):  # fmt: skip
    """``rank``: each shard's width of the slots; ``ranks``: each slot's adapter rank
    (None: the whole width); ``permute``: a random row for each position (the graphs'
    layout); ``max_seg_len``: the host's bound (the graphs': the whole batch); ``dense``:
    the shrink over every slot by token row, read by the expand at each row's slot."""
    gen = torch.Generator().manual_seed(sum(lengths) * 31 + k + n + num_slots)
    tokens = sum(lengths)
    shard_rows = shard_rows or (n,)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    a, b = _weights(gen, num_slots, rank, k, shard_rows, ranks, poison)
    a, b = a.to(dtype), b.to(dtype)
    base = torch.randn(tokens, sum(shard_rows), generator=gen).to(dtype)
    seg_indptr = indptr(lengths)
    seg_slots = torch.tensor(slots, dtype=torch.int32)
    row_order = torch.randperm(tokens, generator=gen).to(torch.int32) if permute else None
    slot_ranks = None if ranks is None else torch.tensor(ranks, dtype=torch.int32)
    layout = {"row_order": row_order, "slot_ranks": slot_ranks}
    h_ref = lora_shrink_ref(
        x.double(), a.double(), seg_indptr, seg_slots, num_shards=len(shard_rows), **layout
    )
    want = lora_expand_ref(
        h_ref, b.double(), base.double().clone(), seg_indptr, seg_slots, shard_rows=shard_rows,
        **layout,
    )  # fmt: skip
    max_len = max_seg_len or max(lengths)
    on = {key: None if t is None else t.to(device) for key, t in layout.items()}
    x_d, a_d, b_d, indptr_d, slots_d = (t.to(device) for t in (x, a, b, seg_indptr, seg_slots))
    if dense:
        h = lora_shrink_dense(x_d, a_d)
        h_ref = _at_slots(
            x.double() @ a.double().flatten(0, 1).t(), num_slots, layout, lengths, slots
        )
    else:
        h = lora_shrink(
            x_d, a_d, indptr_d, slots_d, max_len, splits, num_shards=len(shard_rows), **on
        )
    out = base.to(device).clone()
    got = lora_expand(
        h, b_d, out, indptr_d, slots_d, max_len, shard_rows=shard_rows, h_by_slot=dense, **on
    )
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    tol = _TOLERANCE[dtype]
    if dense:  # (NaN past the ranks with poison, on both sides)
        h = _at_slots(h.cpu().double(), num_slots, layout, lengths, slots).nan_to_num(0.0)
        h_ref = h_ref.nan_to_num(0.0)
    torch.testing.assert_close(h.cpu().double(), h_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(got.cpu().double(), want, atol=tol * 4, rtol=tol * 4)
    bounds = seg_indptr.tolist()
    rows = torch.arange(tokens) if row_order is None else row_order.long()
    for start, end, slot in zip(bounds, bounds[1:], slots, strict=False):
        if slot < 0 or (ranks is not None and ranks[slot] == 0):  # exactly as they were
            assert torch.equal(got.cpu()[rows[start:end]], base[rows[start:end]])


def _at_slots(h_dense, num_slots, layout, lengths, slots) -> torch.Tensor:
    """The dense shrink's ``[T, slots * R]`` read as the expand reads it: for every
    position of a segment with a slot, its token row's block of that slot (``[P, R]``)."""
    order, picked, position = layout["row_order"], [], 0
    blocks = h_dense.view(h_dense.shape[0], num_slots, -1)
    for length, slot in zip(lengths, slots, strict=True):
        for p in range(position, position + length):
            if slot >= 0:
                picked.append(blocks[p if order is None else int(order[p]), slot])
        position += length
    return torch.stack(picked) if picked else h_dense.new_zeros(0)


_CASES = [
    # (segment lengths, their slots): prefill segments, decode rows, base rows between
    ([5, 1, 17, 3], [2, -1, 0, 2]),
    ([1, 1, 1, 1, 1], [0, 1, -1, 2, 0]),
    ([40], [1]),
]
# The decode graphs' layout: one segment per slot (some empty), then the base model's with
# the padding rows; positions permuted over the rows.
_GROUPED = [([3, 0, 4, 5], [0, 1, 2, -1]), ([0, 6, 0, 1], [0, 1, 2, -1]), ([0, 0, 0, 4], [0, 1, 2, -1])]  # fmt: skip


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lengths", "slots"), _CASES)
def test_lora_segments_interpret(dtype, lengths, slots):
    _check(device_for("interpret"), dtype, lengths, slots, k=48, n=40, rank=24)


@pytest.mark.interpret
@pytest.mark.parametrize("splits", [2, 3, 4])
def test_lora_split_k_interpret(splits):
    """Split over K (K = 200 in blocks of 64: 2 splits of 128 + 72 columns, or 4 of 64, the
    last partly masked): the summed partials equal the unsplit products, and rows of
    segments without a slot stay zero."""
    lengths, slots = [5, 1, 17, 3], [2, -1, 0, 2]
    _check(device_for("interpret"), torch.float32, lengths, slots, 200, 40, 24, splits=splits)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lengths", "slots"), _GROUPED)
@pytest.mark.parametrize(("splits", "dense"), [(1, False), (3, False), (None, True)])
def test_lora_grouped_rows_interpret(dtype, lengths, slots, splits, dense):
    """Rows permuted into one segment per slot, the grid sized for the whole batch; the
    shrink segmented (split over K or not) or dense (every slot by token row)."""
    _check(device_for("interpret"), dtype, lengths, slots, k=200, n=40, rank=24,
           splits=splits, permute=True, max_seg_len=sum(lengths), dense=dense)  # fmt: skip


@pytest.mark.interpret
@pytest.mark.parametrize(
    ("shard_rows", "rank", "ranks"),
    [
        ((40,), 24, [8, 24, 0]),  # one shard; a slot never written (rank 0) does nothing
        ((40, 16, 16), 24, [24, 8, 17]),  # QKV: one output block across all three shards
        ((24, 40), 16, [16, 1, 9]),  # gate-up
        ((80,), 160, [64, 160, 100]),  # two column blocks of A (the second past rank 64)
    ],
)
@pytest.mark.parametrize(("permute", "dense"), [(False, False), (True, False), (True, True)])
def test_lora_ranks_and_shards_interpret(shard_rows, rank, ranks, permute, dense):
    """Each slot read only up to its rank in each shard's block, B only on its diagonal:
    the weights there are NaN, and the results still equal the references' (the dense
    shrink's NaN columns, past the ranks and of other slots, never read by the expand)."""
    lengths, slots = ([3, 0, 4, 5], [0, 1, 2, -1]) if permute else ([5, 1, 17, 3], [2, -1, 0, 1])
    _check(device_for("interpret"), torch.float32, lengths, slots, 48, 0, rank,
           permute=permute, ranks=ranks, shard_rows=shard_rows, poison=True,
           max_seg_len=sum(lengths) if permute else None, dense=dense)  # fmt: skip


@pytest.mark.interpret
def test_lora_ranks_change_nothing_on_zero_padding_interpret():
    """With the zeros a LoRA layer's slots hold past each rank, reading at the ranks gives
    what reading every column gives (the rank only skips work)."""
    device = device_for("interpret")
    gen = torch.Generator().manual_seed(3)
    ranks, shard_rows, width = [4, 24, 16], (40, 16, 16), 24
    a, b = _weights(gen, 3, width, 48, shard_rows, ranks, poison=False)
    x, seg_indptr = torch.randn(12, 48, generator=gen), indptr([3, 0, 4, 5])
    seg_slots = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    row_order = torch.randperm(12, generator=gen).to(torch.int32)
    results = []
    for slot_ranks in (None, torch.tensor(ranks, dtype=torch.int32)):
        layout = {"row_order": row_order, "slot_ranks": slot_ranks}
        h = lora_shrink(x.to(device), a.to(device), seg_indptr, seg_slots, 12, num_shards=3,
                        **layout)  # fmt: skip
        out = torch.zeros(12, 72, device=device)
        results.append(lora_expand(h, b.to(device), out, seg_indptr, seg_slots, 12,
                                   shard_rows=shard_rows, **layout).cpu())  # fmt: skip
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("lengths", "slots"), [*_CASES, ([300, 1, 129, 1, 1], [3, 0, -1, 1, 3])])
@pytest.mark.parametrize(
    ("k", "n", "rank"), [(4096, 6144, 48), (4096, 4096, 16), (14336, 4096, 64)]
)
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_lora_segments_gpu(dtype, lengths, slots, k, n, rank, splits):
    _check(device_for("gpu"), dtype, lengths, slots, k, n, rank, num_slots=4, splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("lengths", "slots"),
    [([9, 0, 11, 8, 4], [0, 1, 2, 3, -1]), ([1, 0, 0, 0, 0], [0, 1, 2, 3, -1]),
     ([40, 30, 33, 20, 37], [0, 1, 2, 3, -1])],
)  # fmt: skip
@pytest.mark.parametrize(
    ("k", "shard_rows"),
    [(4096, (4096, 1024, 1024)), (4096, (14336, 14336)), (14336, (4096,)), (4096, (4096,))],
)
@pytest.mark.parametrize(("splits", "dense"), [(None, False), (1, False), (None, True)])
def test_lora_grouped_mixed_ranks_gpu(dtype, lengths, slots, k, shard_rows, splits, dense):
    """Llama-3.1-8B's projections in the decode graphs' layout (one segment per slot, rows
    permuted, the grid sized for the whole batch), slots of rank 64 holding adapters of
    rank 16 and 64 with NaN past the ranks and off B's diagonal; the shrink segmented or
    dense (cuBLAS over every slot)."""
    _check(device_for("gpu"), dtype, lengths, slots, k, 0, 64, num_slots=4, splits=splits,
           permute=True, ranks=[16, 64, 16, 64], shard_rows=shard_rows, poison=True,
           max_seg_len=sum(lengths), dense=dense)  # fmt: skip


def _check_loop(device, dtype, lengths, slots, ranks, shard_rows, masked, k=40, width=16) -> None:
    """:func:`lora_delta_segments` on the segments with a slot (``masked``:
    :func:`lora_delta_masked` with the batch's :func:`row_mask`), the slots held as
    :class:`SlotWeights` (B stored transposed), equals the references (float64) over the
    whole layout, base-model rows untouched."""
    gen = torch.Generator().manual_seed(sum(lengths) + k)
    a, b = _weights(gen, len(ranks), width, k, shard_rows, ranks, poison=False)
    x = torch.randn(sum(lengths), k, generator=gen)
    base = torch.randn(sum(lengths), sum(shard_rows), generator=gen).to(dtype)
    seg_indptr, seg_slots = indptr(lengths), torch.tensor(slots, dtype=torch.int32)
    layout = {"slot_ranks": torch.tensor(ranks, dtype=torch.int32)}
    x, a, b = x.to(dtype), a.to(dtype), b.to(dtype)
    h = lora_shrink_ref(x.double(), a.double(), seg_indptr, seg_slots,
                        num_shards=len(shard_rows), **layout)  # fmt: skip
    want = lora_expand_ref(h, b.double(), base.double().clone(), seg_indptr, seg_slots,
                           shard_rows=shard_rows, **layout)  # fmt: skip
    bounds = seg_indptr.tolist()
    segments = [
        (start, end, slot)
        for start, end, slot in zip(bounds, bounds[1:], slots, strict=False)
        if slot >= 0 and end > start
    ]
    weights = SlotWeights.of(
        a.to(device), b.transpose(1, 2).contiguous().to(device), tuple(shard_rows)
    )
    out = base.to(device).clone()
    if masked:
        mask = row_mask(segments, x.shape[0], len(ranks), dtype, device)
        got = lora_delta_masked(x.to(device), out, weights.a_cat, weights.b_cat, mask)
    else:
        got = lora_delta_segments(x.to(device), out, weights.a_t, weights.b_t, segments)
    assert got.data_ptr() == out.data_ptr()
    tol = _TOLERANCE[dtype] * 4
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)
    for start, end, slot in zip(bounds, bounds[1:], slots, strict=False):
        if slot < 0:
            assert torch.equal(got.cpu()[start:end], base[start:end])


_LOOP_CASES = [  # (lengths, slots, each slot's rank, shards' output rows)
    ([5, 1, 17, 3], [2, -1, 0, 2], [16, 4, 9], (24,)),
    ([30, 2, 7], [1, -1, 0], [3, 16], (20, 8, 8)),
]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lengths", "slots", "ranks", "shard_rows"), _LOOP_CASES)
def test_lora_eager_matmuls_equal_the_references(dtype, lengths, slots, ranks, shard_rows, masked):
    _check_loop("cpu", dtype, lengths, slots, ranks, shard_rows, masked)


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("lengths", "slots", "ranks", "shard_rows"), _LOOP_CASES)
def test_lora_eager_matmuls_gpu(dtype, lengths, slots, ranks, shard_rows, masked):
    _check_loop(device_for("gpu"), dtype, lengths, slots, ranks, shard_rows, masked)


def test_row_mask_marks_each_rows_slot():
    mask = row_mask([(0, 2, 1), (3, 4, 0)], 5, 3, torch.float32, "cpu")
    assert mask.shape == (5, 3, 1)
    assert mask[..., 0].tolist() == [[0, 1, 0], [0, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]]


@pytest.mark.interpret
@pytest.mark.parametrize("dense", [False, True])
def test_lora_expand_reads_b_stored_transposed_interpret(dense):
    """B as :class:`SlotWeights` holds it (a transposed view of ``[slots, R, N]``
    memory): the expand reads it through its strides and gives what contiguous B gives."""
    gen = torch.Generator().manual_seed(9)
    a, b = _weights(gen, 3, 16, 24, (20, 12), [16, 5, 9], poison=False)
    x = torch.randn(11, 24, generator=gen)
    seg_indptr, seg_slots = indptr([4, 2, 5]), torch.tensor([2, -1, 0], dtype=torch.int32)
    ranks = torch.tensor([16, 5, 9], dtype=torch.int32)
    h = lora_shrink_dense(x, a) if dense else lora_shrink_ref(
        x, a, seg_indptr, seg_slots, slot_ranks=ranks, num_shards=2
    )  # fmt: skip
    transposed = b.transpose(1, 2).contiguous().transpose(1, 2)
    assert transposed.stride(2) != 1
    outs = [
        lora_expand(h, weights, torch.zeros(11, 32), seg_indptr, seg_slots, 5,
                    slot_ranks=ranks, shard_rows=(20, 12), h_by_slot=dense)
        for weights in (b, transposed)
    ]  # fmt: skip
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert outs[0].abs().sum() > 0


def test_lora_ref_leaves_base_rows():
    x, a, b = torch.ones(3, 4), torch.ones(1, 2, 4), torch.ones(1, 5, 2)
    seg_indptr, seg_slots = indptr([2, 1]), torch.tensor([-1, 0], dtype=torch.int32)
    out = lora_expand_ref(
        lora_shrink_ref(x, a, seg_indptr, seg_slots), b, torch.zeros(3, 5), seg_indptr, seg_slots
    )
    assert out[:2].abs().sum() == 0 and torch.all(out[2] == 8)


def test_lora_ref_expand_reads_the_dense_shrink_at_each_rows_slot():
    """The dense shrink (every row by every slot) read at each row's slot equals the
    segmented shrink by position, and both expands give the same output."""
    gen = torch.Generator().manual_seed(5)
    a, b = _weights(gen, 3, 8, 12, (10, 6), [8, 3, 5], poison=False)
    x = torch.randn(9, 12, generator=gen)
    seg_indptr, seg_slots = indptr([2, 3, 0, 4]), torch.tensor([1, -1, 0, 2], dtype=torch.int32)
    layout = {
        "row_order": torch.randperm(9, generator=gen).to(torch.int32),
        "slot_ranks": torch.tensor([8, 3, 5], dtype=torch.int32),
    }
    h = lora_shrink_ref(x, a, seg_indptr, seg_slots, num_shards=2, **layout)
    expand = {"shard_rows": (10, 6), **layout}
    want = lora_expand_ref(h, b, torch.zeros(9, 16), seg_indptr, seg_slots, **expand)
    dense = lora_shrink_dense(x, a)
    got = lora_expand_ref(
        dense, b, torch.zeros(9, 16), seg_indptr, seg_slots, h_by_slot=True, **expand
    )
    torch.testing.assert_close(got, want)
    assert got.abs().sum() > 0 and torch.all(got[layout["row_order"][2:5].long()] == 0)


def test_lora_ref_permuted_rows_and_ranks():
    """Position ``p`` is row ``row_order[p]``; slot 0 at rank 1 of 2: one column."""
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    a = torch.tensor([[[1.0, 2.0], [5.0, 5.0]]])  # rank 1: only the first row counts
    b = torch.tensor([[[1.0, 7.0], [2.0, 7.0]]])
    seg_indptr, seg_slots = indptr([2, 1]), torch.tensor([0, -1], dtype=torch.int32)
    layout = {"row_order": torch.tensor([2, 0, 1], dtype=torch.int32),
              "slot_ranks": torch.tensor([1], dtype=torch.int32)}  # fmt: skip
    h = lora_shrink_ref(x, a, seg_indptr, seg_slots, **layout)
    assert h.tolist() == [[3.0, 0.0], [1.0, 0.0], [0.0, 0.0]]
    out = lora_expand_ref(h, b, torch.zeros(3, 2), seg_indptr, seg_slots, **layout)
    assert out.tolist() == [[1.0, 2.0], [0.0, 0.0], [3.0, 6.0]]


def _check_onto_base(device, dtype, lengths, slots, ranks, shard_rows, k=40, width=16) -> None:
    """:func:`lora_expand` with ``base``: the decode graphs' layout (rows permuted, one
    segment per slot, the base model's and padding rows last), ``h`` and ``base`` the
    two column ranges of one GEMM by ``[W; every slot's A]``, ``out`` full of NaN: every
    row written, ``base + delta`` (the base segment's rows: ``base``), as the references
    give it in float64; weights past each rank NaN, never read."""
    gen = torch.Generator().manual_seed(sum(lengths) * 7 + k)
    tokens, n = sum(lengths), sum(shard_rows)
    a, b = _weights(gen, len(ranks), width, k, shard_rows, ranks, poison=True)
    weight = torch.randn(n, k, generator=gen) * k**-0.5
    x = torch.randn(tokens, k, generator=gen)
    x, a, b, weight = x.to(dtype), a.to(dtype), b.to(dtype), weight.to(dtype)
    joint = torch.cat([weight, a.flatten(0, 1)])
    seg_indptr, seg_slots = indptr(lengths), torch.tensor(slots, dtype=torch.int32)
    layout = {
        "row_order": torch.randperm(tokens, generator=gen).to(torch.int32),
        "slot_ranks": torch.tensor(ranks, dtype=torch.int32),
    }
    y_ref = x.double() @ joint.double().t()
    expand = {"shard_rows": shard_rows, "h_by_slot": True, **layout}
    want = lora_expand_ref(y_ref[:, n:], b.double(), torch.full((tokens, n), float("nan"),
                           dtype=torch.float64), seg_indptr, seg_slots, base=y_ref[:, :n],
                           **expand)  # fmt: skip
    on = {key: t.to(device) if isinstance(t, torch.Tensor) else t for key, t in expand.items()}
    y = torch.nn.functional.linear(x.to(device), joint.to(device))
    out = torch.full((tokens, n), float("nan"), dtype=dtype, device=device)
    got = lora_expand(y[:, n:], b.to(device), out, seg_indptr.to(device), seg_slots.to(device),
                      tokens, base=y[:, :n], **on)  # fmt: skip
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    assert not want.isnan().any()
    tol = _TOLERANCE[dtype] * 4
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)
    base_rows = layout["row_order"][int(seg_indptr[-2]) :].long()
    torch.testing.assert_close(got.cpu()[base_rows], y.cpu()[base_rows, :n], atol=0, rtol=0)


_ONTO_BASE_CASES = [  # the graphs' layouts: (lengths, slots, each slot's rank, shard rows)
    ([3, 0, 4, 5], [0, 1, 2, -1], [16, 4, 9], (24, 8, 8)),
    ([0, 6, 0, 1], [0, 1, 2, -1], [16, 4, 0], (40,)),
    ([0, 0, 0, 4], [0, 1, 2, -1], [16, 16, 16], (24, 24)),
    ([1, 0, 0, 0], [0, 1, 2, -1], [5, 16, 16], (40,)),
]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lengths", "slots", "ranks", "shard_rows"), _ONTO_BASE_CASES)
def test_lora_expand_onto_base_interpret(dtype, lengths, slots, ranks, shard_rows):
    _check_onto_base(device_for("interpret"), dtype, lengths, slots, ranks, shard_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lengths", "slots", "ranks", "shard_rows"), _ONTO_BASE_CASES)
def test_lora_expand_onto_base_gpu(dtype, lengths, slots, ranks, shard_rows):
    _check_onto_base(device_for("gpu"), dtype, lengths, slots, ranks, shard_rows)


def test_lora_ref_expand_onto_base_sets_every_row():
    seg_indptr, seg_slots = indptr([1, 2]), torch.tensor([0, -1], dtype=torch.int32)
    h, b = torch.ones(3, 2), torch.ones(1, 4, 2)
    base = torch.arange(12.0).view(3, 4)
    out = lora_expand_ref(h, b, torch.full((3, 4), float("nan")), seg_indptr, seg_slots,
                          row_order=torch.tensor([2, 0, 1], dtype=torch.int32),
                          h_by_slot=True, base=base)  # fmt: skip
    assert torch.equal(out[2], base[2] + 2) and torch.equal(out[:2], base[:2])


def _qkv_layers(device, dtype, num_slots=3, max_rank=8):
    """The same QKV projection (8 query and 2 key/value heads of 4) wrapped twice, with
    the same random slots: joined with its base weight, and not."""
    from kvflow.runtime.layers import QKVLinear
    from kvflow.runtime.lora import LoraContext, LoraLinear

    gen = torch.Generator().manual_seed(3)
    context, layers = LoraContext(), []
    weight = torch.randn(48, 24, generator=gen).to(dtype)
    a = torch.randn(num_slots, 3, max_rank, 24, generator=gen).to(dtype)
    b = [torch.randn(num_slots, rows, max_rank, generator=gen).to(dtype) for rows in (32, 8, 8)]
    for join in (True, False):
        base = QKVLinear(24, 4, 8, 2, bias=False).to(device=device, dtype=dtype)
        base.weight.data.copy_(weight)
        lora = LoraLinear(base, context, num_slots, max_rank, dtype, device, join_base=join)
        for slot in range(num_slots):
            for shard in range(3):
                lora.write_slot(slot, shard, a[slot, shard], b[shard][slot])
        layers.append(lora)
    return context, layers, weight


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joined_projection_equals_separate_interpret(dtype):
    _check_joined(device_for("interpret"), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joined_projection_equals_separate_gpu(dtype):
    _check_joined(device_for("gpu"), dtype)


def _check_joined(device, dtype) -> None:
    """A LoRA layer joined with its base weight (one buffer: the weight, then every
    slot's A) gives, for the decode graphs' layout and the eager batches it takes, what
    the separate matmuls give; its base weight is the same view for every other path."""
    from kvflow.runtime.lora import LoraBatch

    context, (joined, separate), weight = _qkv_layers(device, dtype)
    assert joined.weights.joint is not None and separate.weights.joint is None
    assert joined.base.weight.data_ptr() == joined.weights.joint.data_ptr()
    assert torch.equal(joined.base.weight.cpu(), weight)
    assert torch.equal(joined.weights.joint[48:].view_as(joined.a_slots), separate.a_slots)
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(4)).to(dtype).to(device)
    context.batch = LoraBatch(
        indptr([2, 0, 1, 3]).to(device), torch.tensor([0, 1, 2, -1], dtype=torch.int32,
        device=device), 6, row_order=torch.tensor([4, 1, 0, 2, 3, 5], dtype=torch.int32,
        device=device), slot_ranks=torch.tensor([8, 3, 5], dtype=torch.int32, device=device),
    )  # fmt: skip
    assert context.batch.joins(x)
    got, want = joined(x), separate(x)
    tol = _TOLERANCE[dtype] * 4
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert not torch.equal(got[[4, 1, 0]], x[[4, 1, 0]] @ weight.to(device).t())  # deltas
    _check_eager_joined(context, joined, separate, x, tol)


def _check_eager_joined(context, joined, separate, x, tol) -> None:
    """Eager batches: one segment over every row and a row mask take the joint GEMM;
    one segment over some rows takes the base weight's view and the separate matmuls."""
    from kvflow.runtime.lora import LoraBatch

    device = str(x.device)
    whole = LoraBatch.of([1], [6], device)
    some = LoraBatch.of([0, -1], [4, 2], device)
    mixed = LoraBatch.of([0, -1, 2], [2, 1, 3], device)  # (no mask without num_slots)
    assert whole is not None and some is not None and mixed is not None and mixed.segments
    masked = dataclasses.replace(
        mixed, row_mask=row_mask(mixed.segments, 6, 3, x.dtype, device)
    )  # fmt: skip
    for batch, joins in ((whole, True), (some, False), (mixed, False), (masked, True)):
        context.batch = batch
        assert batch.joins(x) is joins
        got = joined(x)
        context.batch = mixed if batch is masked else batch
        torch.testing.assert_close(got, separate(x), atol=tol, rtol=tol)
    context.batch = None


def test_a_projection_with_a_bias_keeps_its_own_weight():
    from kvflow.runtime.layers import QKVLinear
    from kvflow.runtime.lora import LoraContext, LoraLinear

    base = QKVLinear(24, 4, 8, 2, bias=True).to(torch.float32)
    lora = LoraLinear(base, LoraContext(), 2, 8, torch.float32, "cpu", join_base=True)
    assert lora.weights.joint is None
