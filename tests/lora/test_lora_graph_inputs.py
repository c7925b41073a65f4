"""LoRA's part of the decode CUDA graphs' inputs, on the host side (the graphs themselves
run on the GPU: tests/gpu/test_gpu_lora.py): every row its own one-row segment, each
row's slot written before a replay, padding and the base model's rows at -1, and the
LoRA layers reading the static segments while a graph is captured."""

from __future__ import annotations

import pytest
import torch

from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode
from kvflow.runtime.lora import LoraGraphInputs


class _Manager:
    """What LoraGraphInputs uses of a LoraManager: its device, context and slot plan."""

    def __init__(self) -> None:
        from kvflow.runtime.lora import LoraContext, LoraSlots

        self.device = "cpu"
        self.context = LoraContext()
        self.slots = LoraSlots(2)

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


def test_each_row_gets_its_slot_and_padding_the_base_model():
    manager = _Manager()
    inputs = LoraGraphInputs(manager)  # type: ignore[arg-type]
    inputs.init_capture(8)
    assert inputs.seg_indptr.tolist() == list(range(9))
    inputs.fill_replay(_decode(["a", None, "b", "a"]), 8)
    slot_a, slot_b = manager.slots.plan(["a", "b"]).slots.values()
    assert inputs.seg_slots.tolist() == [slot_a, -1, slot_b, slot_a, -1, -1, -1, -1]
    inputs.fill_replay(_decode([None, None]), 2)  # no adapter: every row the base model
    assert inputs.seg_slots[:2].tolist() == [-1, -1]


def test_a_graph_being_captured_reads_the_static_segments():
    manager = _Manager()
    inputs = LoraGraphInputs(manager)  # type: ignore[arg-type]
    inputs.init_capture(4)
    with inputs.capturing(2):
        batch = manager.context.batch
        assert batch is not None and batch.max_seg_len == 1
        assert batch.seg_indptr.data_ptr() == inputs.seg_indptr.data_ptr()
        assert batch.seg_slots.data_ptr() == inputs.seg_slots.data_ptr()
        assert batch.seg_indptr.tolist() == [0, 1, 2]
    assert manager.context.batch is None
    with pytest.raises(RuntimeError), inputs.capturing(1):
        raise RuntimeError("capture failed")
    assert manager.context.batch is None
