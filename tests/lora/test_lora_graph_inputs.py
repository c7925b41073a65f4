"""LoRA's part of the decode CUDA graphs' inputs, on the host side (the graphs themselves
run on the GPU: tests/gpu/test_gpu_lora.py): the rows grouped by slot into one segment per
slot and one for the base model and the padding, the permutation and bounds written before
a replay, and the LoRA layers reading the static buffers while a graph is captured."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import lora_expand_ref, lora_shrink_ref
from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode
from kvflow.runtime.lora import LoraGraphInputs
from kvflow.runtime.lora.graph import group_rows


class _Manager:
    """What LoraGraphInputs uses of a LoraManager: its device, context, slot plan and the
    slots' ranks."""

    def __init__(self, num_slots: int = 2) -> None:
        from kvflow.runtime.lora import LoraContext, LoraSlots

        self.device = "cpu"
        self.context = LoraContext()
        self.slots = LoraSlots(num_slots)
        self.slot_ranks = torch.zeros(num_slots, dtype=torch.int32)

    def assign_slots(self, fb: ForwardBatch) -> list[int] | None:
        names = [n for n in fb.lora_paths if n is not None]
        if not names:
            return None
        plan = self.slots.plan(names)
        return [-1 if n is None else plan.slots[n] for n in fb.lora_paths]


def _decode(paths: list[str | None]) -> ForwardBatch:
    bs = len(paths)
    rows = {k: torch.zeros(bs, dtype=torch.int64) for k in ("input_ids", "positions")}
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        out_cache_loc=torch.zeros(bs, dtype=torch.int64),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64),
        seq_lens=torch.ones(bs, dtype=torch.int64),
        seq_lens_cpu=[1] * bs,
        lora_paths=paths,
        **rows,
    )


def test_group_rows_sorts_by_slot_with_base_and_padding_last():
    groups = group_rows([1, -1, 0, 1, 2, -1, 0], 10, 4)
    # slot 0: rows 2, 6; slot 1: 0, 3; slot 2: 4; slot 3: none; base: 1, 5, padding 7-9
    assert groups.seg_indptr == [0, 2, 4, 5, 5, 10]
    assert groups.row_order == [2, 6, 0, 3, 4, 1, 5, 7, 8, 9]
    assert group_rows([], 4, 2) == ([0, 0, 0, 4], [0, 1, 2, 3])


def test_each_slot_one_segment_and_padding_the_base_model():
    manager = _Manager()
    inputs = LoraGraphInputs(manager)  # type: ignore[arg-type]
    inputs.init_capture(8)
    assert inputs.seg_slots.tolist() == [0, 1, -1]
    inputs.fill_replay(_decode(["a", None, "b", "a"]), 8)
    slot_a, slot_b = (manager.slots.plan(["a", "b"]).slots[n] for n in "ab")
    rows = {slot_a: [0, 3], slot_b: [2]}
    assert inputs.seg_indptr.tolist() == [0, len(rows[0]), 3, 8]
    assert inputs.row_order.tolist() == [*rows[0], *rows[1], 1, 4, 5, 6, 7]
    inputs.fill_replay(_decode([None, None]), 2)  # no adapter: every row the base model
    assert inputs.seg_indptr.tolist() == [0, 0, 0, 2]
    assert inputs.row_order[:2].tolist() == [0, 1]


def test_a_graph_being_captured_reads_the_static_buffers():
    manager = _Manager()
    inputs = LoraGraphInputs(manager)  # type: ignore[arg-type]
    inputs.init_capture(4)
    inputs.fill_replay(_decode([]), 2)
    with inputs.capturing(2):
        batch = manager.context.batch
        assert batch is not None and batch.max_seg_len == 2
        assert batch.seg_indptr.data_ptr() == inputs.seg_indptr.data_ptr()
        assert batch.seg_slots.data_ptr() == inputs.seg_slots.data_ptr()
        assert batch.row_order is not None and batch.row_order.shape == (2,)
        assert batch.row_order.data_ptr() == inputs.row_order.data_ptr()
        assert batch.slot_ranks is manager.slot_ranks
        assert batch.seg_indptr.tolist() == [0, 0, 0, 2]
    assert manager.context.batch is None
    with pytest.raises(RuntimeError), inputs.capturing(1):
        raise RuntimeError("capture failed")
    assert manager.context.batch is None


def test_grouped_layout_gives_each_row_its_adapters_delta():
    """The layout a replay writes, through the torch references: each row gets its own
    adapter's delta at that adapter's rank, base and padding rows none."""
    manager = _Manager(num_slots=3)
    manager.slot_ranks[:] = torch.tensor([2, 4, 0], dtype=torch.int32)
    inputs = LoraGraphInputs(manager)  # type: ignore[arg-type]
    inputs.init_capture(8)
    paths = ["a", None, "b", "a", "b", "b"]
    inputs.fill_replay(_decode(paths), 8)
    slot = manager.slots.plan(["a", "b"]).slots
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    a = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64)
    b = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64)
    layout = {"row_order": inputs.row_order[:8], "slot_ranks": manager.slot_ranks}
    h = lora_shrink_ref(x, a, inputs.seg_indptr, inputs.seg_slots, **layout)
    out = lora_expand_ref(h, b, torch.zeros(8, 5, dtype=torch.float64), inputs.seg_indptr,
                          inputs.seg_slots, **layout)  # fmt: skip
    for row in range(8):
        name = paths[row] if row < len(paths) else None
        if name is None:
            assert torch.equal(out[row], torch.zeros(5, dtype=torch.float64))
            continue
        rank = int(manager.slot_ranks[slot[name]])
        s = slot[name]
        want = x[row] @ a[s, :rank].t() @ b[s, :, :rank].t()
        torch.testing.assert_close(out[row], want)
