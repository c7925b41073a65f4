"""The native CPU paged-attention kernel against its torch reference (no GPU, no Triton)."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.kernels.cpu import available, paged_attention, paged_attention_ref

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler for the native kernels")

SLOTS = 4096


def _case(dtype, heads, kv_heads, dim, lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(SLOTS, kv_heads, dim, generator=gen).to(dtype)
    v_buf = torch.randn(SLOTS, kv_heads, dim, generator=gen).to(dtype)
    table = torch.zeros(len(lens) + 2, 1024, dtype=torch.int32)
    rows = torch.randperm(table.shape[0], generator=gen)[: len(lens)]
    for row, length in zip(rows.tolist(), lens, strict=True):
        table[row, :length] = torch.randperm(SLOTS, generator=gen)[:length].to(torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    return q, k_buf, v_buf, table, rows.to(torch.int64), torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(9, 3, 64), (4, 4, 32), (8, 1, 128), (16, 2, 80), (64, 8, 64), (6, 2, 72)],
)
@pytest.mark.parametrize("copies", [1, 20], ids=["per-head-items", "per-row-items"])
def test_matches_reference(dtype, heads, kv_heads, dim, copies) -> None:
    # ragged: one slot, under a block, exactly a block, blocks plus a tail, long; many rows
    # make each work item one row with all its heads (while there are enough per thread)
    lens = [1, 7, 32, 33, 100, 515, 1000][: 7 if copies == 1 else 5] * copies
    args = _case(dtype, heads, kv_heads, dim, lens)
    scale = 1 / math.sqrt(dim)
    got = paged_attention(*args, scale)
    want = paged_attention_ref(*args, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _extend_rows(spans: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows of extends: ``(table row, cached prefix, new tokens)`` -> rows, visible.
    New token j of a request sees its prefix and new tokens 0..j (causal)."""
    rows, visible = [], []
    for row, prefix, new in spans:
        rows += [row] * new
        visible += range(prefix + 1, prefix + new + 1)
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(visible, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 1, 128), (6, 2, 72), (4, 2, 33)]
)
def test_extend_tiles_match_reference(dtype, heads, kv_heads, dim) -> None:
    """Consecutive rows of one request (an extend) are attended as tiles that share each K/V
    block (scored from a transposed block); tiles are cut at the per-item cap, at request
    boundaries and where a row does not continue the previous one; single rows in between
    take the one-row path."""
    gen = torch.Generator().manual_seed(1)
    q, k_buf, v_buf, table, _, _ = _case(dtype, heads, kv_heads, dim, [1000] * 6, seed=3)
    spans = [(0, 0, 170), (1, 37, 5), (2, 500, 1), (3, 0, 1), (4, 31, 64), (5, 900, 33)]
    rows, visible = _extend_rows(spans)
    q = torch.randn(rows.numel(), heads, dim, generator=gen).to(dtype)
    scale = 1 / math.sqrt(dim)
    got = paged_attention(q, k_buf, v_buf, table, rows, visible, scale)
    want = paged_attention_ref(q, k_buf, v_buf, table, rows, visible, scale)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # float32 sums over up to 933 slots
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_a_run_starting_at_nothing_gives_zeros_then_attends() -> None:
    """A run whose first row sees no slot: that row is zeros, the next sees one slot."""
    q, k_buf, v_buf, table, _, _ = _case(torch.float32, 4, 2, 16, [5])
    rows = torch.zeros(3, dtype=torch.int64)
    rows[:] = int(torch.nonzero(table[:, 0]).flatten()[0])
    got = paged_attention(q[:1].expand(3, 4, 16), k_buf, v_buf, table, rows, torch.arange(3), 0.25)
    assert torch.count_nonzero(got[0]) == 0
    slot = int(table[rows[0], 0])
    torch.testing.assert_close(got[1], v_buf[slot].repeat_interleave(2, dim=0))


def test_one_slot_returns_its_value_and_empty_rows_are_zero() -> None:
    q, k_buf, v_buf, table, rows, _ = _case(torch.float32, 4, 2, 16, [1, 5])
    got = paged_attention(q, k_buf, v_buf, table, rows, torch.tensor([1, 0]), 0.25)
    slot = int(table[rows[0], 0])
    torch.testing.assert_close(got[0], v_buf[slot].repeat_interleave(2, dim=0))
    assert torch.count_nonzero(got[1]) == 0


def test_strided_query_and_output_views() -> None:
    """q as the model produces it (a column slice of the fused qkv projection), out a view."""
    heads, kv_heads, dim = 6, 2, 32
    q, k_buf, v_buf, table, rows, visible = _case(torch.bfloat16, heads, kv_heads, dim, [40, 9])
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    qkv[:, : heads * dim] = q.reshape(2, -1)
    strided_q = qkv[:, : heads * dim].view(2, heads, dim)
    assert not strided_q.is_contiguous()
    out_storage = torch.zeros(2, heads, 2 * dim, dtype=torch.bfloat16)
    out = out_storage[:, :, :dim]
    paged_attention(strided_q, k_buf, v_buf, table, rows, visible, 0.2, out=out)
    want = paged_attention_ref(q, k_buf, v_buf, table, rows, visible, 0.2)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(out_storage[:, :, dim:]) == 0  # nothing written outside out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "q": a["q"].half()}, "unsupported"),
        (lambda a: {**a, "req_to_token": a["req_to_token"].long()}, "int32"),
        (lambda a: {**a, "rows": a["rows"].int()}, "int64"),
        (lambda a: {**a, "visible": a["visible"][:1]}, "entries"),
        (lambda a: {**a, "v_buffer": a["v_buffer"][:, :1]}, "same shape"),
        (lambda a: {**a, "k_buffer": a["k_buffer"].float()}, "CPU"),
    ],
)
def test_bad_arguments_are_refused(change, message) -> None:
    q, k_buf, v_buf, table, rows, visible = _case(torch.bfloat16, 4, 2, 16, [3, 4])
    args = {
        "q": q,
        "k_buffer": k_buf,
        "v_buffer": v_buf,
        "req_to_token": table,
        "rows": rows,
        "visible": visible,
    }
    with pytest.raises(ValueError, match=message):
        paged_attention(**change(args), sm_scale=0.25)


def test_an_unwritable_cache_is_a_build_error(tmp_path, monkeypatch) -> None:
    """No usable cache folder means no native kernels (the torch paths run), not a crash."""
    from kvflow.kernels.cpu import build

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(blocker))  # a file: mkdir under it fails
    build.load_library.cache_clear()
    try:
        with pytest.raises(build.NativeBuildError, match="cannot build"):
            build.load_library()
    finally:
        build.load_library.cache_clear()


def _disjoint_case(dtype, heads, kv_heads, dim, spans, seed=0):
    """Extends ``(prefix, new)`` over disjoint slots (table row i for request i): q, pools,
    table, rows, visible, and each request's slots."""
    gen = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(SLOTS, kv_heads, dim, generator=gen).to(dtype)
    v_buf = torch.randn(SLOTS, kv_heads, dim, generator=gen).to(dtype)
    table = torch.zeros(len(spans), 1024, dtype=torch.int32)
    free, used, owned = torch.randperm(SLOTS, generator=gen).to(torch.int32), 0, []
    for i, (prefix, new) in enumerate(spans):
        table[i, : prefix + new] = free[used : used + prefix + new]
        owned.append(free[used : used + prefix + new].long())
        used += prefix + new
    rows, visible = _extend_rows([(i, p, n) for i, (p, n) in enumerate(spans)])
    q = torch.randn(rows.numel(), heads, dim, generator=gen).to(dtype)
    return q, k_buf, v_buf, table, rows, visible, owned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 1, 128), (4, 2, 33)])
@pytest.mark.parametrize("window", [1, 5, 32, 45, 4096])
def test_sliding_window_matches_reference_and_reads_no_slot_before_it(
    dtype, heads, kv_heads, dim, window
) -> None:
    """Decode rows and extend tiles with a window: each row sees its last ``window`` slots.
    Slots before every row's window hold NaN, so reading one would show."""
    # decode rows (new 1) shorter and longer than the window, extends across block borders
    spans = [(0, 1), (6, 1), (100, 1), (515, 1), (0, 70), (37, 5), (200, 40), (31, 64)]
    q, k_buf, v_buf, table, rows, visible, owned = _disjoint_case(
        dtype, heads, kv_heads, dim, spans
    )
    for (prefix, _), slots in zip(spans, owned, strict=True):
        unread = slots[: max(0, prefix + 1 - window)]  # before the first new token's window
        k_buf[unread] = float("nan")
        v_buf[unread] = float("nan")
    scale = 1 / math.sqrt(dim)
    got = paged_attention(q, k_buf, v_buf, table, rows, visible, scale, window=window)
    want = paged_attention_ref(q, k_buf, v_buf, table, rows, visible, scale, window=window)
    assert not want.isnan().any()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 33)])
@pytest.mark.parametrize("window", [None, 32])
def test_softcap_matches_reference(dtype, heads, kv_heads, dim, window) -> None:
    """Scores soft-capped at 1.0 (Gemma 2's ``cap * tanh(s / cap)``), decode rows and extend
    tiles, with and without a window; the cap changes these outputs."""
    spans = [(0, 1), (100, 1), (0, 70), (37, 5), (200, 40)]
    q, k_buf, v_buf, table, rows, visible, _ = _disjoint_case(dtype, heads, kv_heads, dim, spans)
    scale = 1 / math.sqrt(dim)
    args = (q, k_buf, v_buf, table, rows, visible, scale)
    got = paged_attention(*args, window=window, logit_cap=1.0)
    want = paged_attention_ref(*args, window=window, logit_cap=1.0)
    uncapped = paged_attention_ref(*args, window=window)
    assert (uncapped.float() - want.float()).abs().max() > 0.05
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_window_of_one_returns_each_rows_own_value() -> None:
    q, k_buf, v_buf, table, rows, visible, owned = _disjoint_case(
        torch.float32, 4, 2, 16, [(5, 3), (0, 1)]
    )
    got = paged_attention(q, k_buf, v_buf, table, rows, visible, 0.25, window=1)
    own = torch.cat([owned[0][5:], owned[1]])
    torch.testing.assert_close(got, v_buf[own].repeat_interleave(2, dim=1))
    with pytest.raises(ValueError, match="window"):
        paged_attention(q, k_buf, v_buf, table, rows, visible, 0.25, window=0)
