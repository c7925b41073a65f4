"""decode_attention_table_fwd (slots read from the request-to-token table) against its
reference: rows out of order, unused rows, ragged lengths, padding-style rows; a sliding
window, with the slots before it poisoned (NaN) to show they are not read; soft-capped
scores (Gemma 2)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import ATTENTION_TOLERANCE, device_for, paged_slots

from kvflow.kernels import decode_attention_table_fwd, decode_attention_table_ref


def _run_case(
    device, dtype, num_kv_heads, group, head_dim, lengths, page_size, splits, window=None,
    logit_cap=None,
):  # fmt: skip
    gen = torch.Generator().manual_seed(sum(lengths) * 17 + group + head_dim)
    num_rows, max_len = len(lengths) + 3, max(lengths) + 5
    num_slots = (sum(-(-n // page_size) for n in lengths) + 8) * page_size
    k_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    # Rows hold other requests' garbage beyond each length; requests take shuffled rows.
    table = torch.randint(0, num_slots, (num_rows, max_len), generator=gen, dtype=torch.int32)
    rows = torch.randperm(num_rows, generator=gen)[: len(lengths)]
    slots = paged_slots(lengths, page_size, num_slots, gen).split(lengths)
    for row, row_slots in zip(rows.tolist(), slots, strict=True):
        table[row, : row_slots.numel()] = row_slots
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    expected = decode_attention_table_ref(
        q, k_buffer, v_buffer, table, rows, seq_lens, head_dim**-0.5, window, logit_cap
    )
    if logit_cap is not None:  # the cap must matter for these scores
        uncapped = decode_attention_table_ref(
            q, k_buffer, v_buffer, table, rows, seq_lens, head_dim**-0.5, window
        )
        assert (uncapped.float() - expected.float()).abs().max() > 0.05
    if window is not None:
        for row_slots in slots:
            unread = row_slots[: max(0, row_slots.numel() - window)].long()
            k_buffer[unread] = float("nan")
            v_buffer[unread] = float("nan")
        assert not expected.isnan().any()
    args = [t.to(device) for t in (q, k_buffer, v_buffer)]
    out = torch.full_like(args[0], float("nan"))
    decode_attention_table_fwd(
        *args, out, table.to(device), rows.to(device), seq_lens.to(device), head_dim**-0.5,
        num_kv_splits=splits, window=window, logit_cap=logit_cap,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu(), expected, **ATTENTION_TOLERANCE[dtype])


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

INTERPRET_CASES = [
    (BF16, 2, 4, 64, [70, 3, 129], 16, 4),
    (FP32, 2, 1, 64, [1, 37, 150], 1, None),
    (FP16, 1, 8, 32, [200, 1], 8, 16),
]


@pytest.mark.interpret
@pytest.mark.parametrize("case", INTERPRET_CASES)
def test_decode_attention_table_interpret(case):
    _run_case(device_for("interpret"), *case)


@pytest.mark.interpret
@pytest.mark.parametrize("window", [1, 16, 45])
@pytest.mark.parametrize("case", INTERPRET_CASES)
def test_decode_attention_table_window_interpret(case, window):
    """Requests shorter and longer than the window; splits over the window alone."""
    _run_case(device_for("interpret"), *case, window=window)


@pytest.mark.interpret
@pytest.mark.parametrize("window", [None, 45])
@pytest.mark.parametrize("case", INTERPRET_CASES)
def test_decode_attention_table_softcap_interpret(case, window):
    """Scores soft-capped at 1.0, over every split, with and without a window."""
    _run_case(device_for("interpret"), *case, window=window, logit_cap=1.0)


GPU_CASES = [
    (8, 4, 128, [1024] * 4, 16, None),
    (8, 4, 128, [1, 17, 64, 65, 1000, 3000, 7], 16, None),
    (8, 4, 128, [2560] * 33 + [1] * 7, 16, None),  # a padded graph batch
    (2, 8, 64, [4096, 1, 513], 16, 2),
    (4, 1, 96, [100, 900], 1, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("case", GPU_CASES)
def test_decode_attention_table_gpu(dtype, case):
    _run_case(device_for("gpu"), dtype, *case)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("case", GPU_CASES[1:4])
def test_decode_attention_table_softcap_window_gpu(dtype, case):
    _run_case(device_for("gpu"), dtype, *case, window=700, logit_cap=1.0)
