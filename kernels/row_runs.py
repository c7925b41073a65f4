"""Copy runs of rows from one 2-D buffer into another in one pass: run ``i`` moves
``counts[i]`` rows from source row ``src_starts[i]`` to destination row ``dst_starts[i]``.

What a KV transfer plan is on one device (or between devices the source device can write
to): per K or V buffer, a run per page. One program copies up to ``ROWS`` rows of one run,
so a 16-slot page is one program and a long contiguous run is spread over many; no index
per row, no temporary (an ``index_select`` + ``index_copy_`` pair moves every byte twice
and expands an index per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels._launch import next_power_of_2

__all__ = ["copy_row_runs", "copy_row_runs_ref", "copy_slot_runs"]

ROWS = 16


@triton.jit
def _copy_rows(
    src_ptr, dst_ptr, src_start_ptr, dst_start_ptr, count, run, first, width,
    ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Rows ``first .. first + ROWS - 1`` of run ``run`` (``count`` rows long)."""
    src_row = tl.load(src_start_ptr + run).to(tl.int64) + first
    dst_row = tl.load(dst_start_ptr + run).to(tl.int64) + first
    rows = tl.arange(0, ROWS)
    row_ok = rows < count - first
    for w in range(0, width, BLOCK_W):
        cols = w + tl.arange(0, BLOCK_W)
        mask = row_ok[:, None] & (cols[None, :] < width)
        values = tl.load(src_ptr + (src_row + rows)[:, None] * width + cols[None, :], mask=mask)
        tl.store(dst_ptr + (dst_row + rows)[:, None] * width + cols[None, :], values, mask=mask)


@triton.jit
def _copy_row_runs_kernel(
    src_ptr, dst_ptr, src_start_ptr, dst_start_ptr, count_ptr, width,
    ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    run = tl.program_id(0)
    first = tl.program_id(1) * ROWS
    count = tl.load(count_ptr + run)
    if first < count:
        _copy_rows(
            src_ptr, dst_ptr, src_start_ptr, dst_start_ptr, count, run, first, width, ROWS, BLOCK_W
        )  # fmt: skip


def copy_row_runs(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_starts: torch.Tensor,
    dst_starts: torch.Tensor,
    counts: torch.Tensor,
    longest: int,
) -> None:
    """The runs (int64 tensors on ``src``'s device) of ``src`` ``[rows, width]`` into
    ``dst`` ``[rows, width]`` (contiguous, one dtype); ``longest`` is the largest count
    (known on the host: it sizes the grid). Enqueued on the current stream."""
    assert src.dtype == dst.dtype and src.shape[1] == dst.shape[1]
    assert src.is_contiguous() and dst.is_contiguous()
    runs = counts.numel()
    if runs == 0 or longest == 0:
        return
    width = src.shape[1]
    grid = (runs, triton.cdiv(longest, ROWS))
    _copy_row_runs_kernel[grid](
        src, dst, src_starts, dst_starts, counts, width,
        ROWS=ROWS, BLOCK_W=min(next_power_of_2(width), 256),
    )  # fmt: skip


@triton.jit
def _copy_slot_runs_kernel(
    src_bases, dst_bases, src_start_ptr, dst_start_ptr, count_ptr, width,
    WORD: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    run = tl.program_id(0)
    first = tl.program_id(1) * ROWS
    buffer = tl.program_id(2)
    count = tl.load(count_ptr + run)
    if first < count:
        src_ptr = tl.load(src_bases + buffer).to(tl.pointer_type(WORD))
        dst_ptr = tl.load(dst_bases + buffer).to(tl.pointer_type(WORD))
        _copy_rows(
            src_ptr, dst_ptr, src_start_ptr, dst_start_ptr, count, run, first, width, ROWS, BLOCK_W
        )  # fmt: skip


_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


def copy_slot_runs(
    table: torch.Tensor, num_buffers: int, row_bytes: int, longest: int, word: int = 8
) -> None:
    """Copy the same runs of rows in ``num_buffers`` buffer pairs, all in one launch.

    ``table`` is one int64 tensor on the launching device: the source buffers' addresses
    (``num_buffers``), the destinations' (``num_buffers``), then the runs' source starts,
    destination starts and counts (``runs`` each). Rows are ``row_bytes`` long; run ``i``
    moves ``counts[i]`` rows from source row ``src_starts[i]`` to destination row
    ``dst_starts[i]`` of every pair. A destination may live on another device this one
    has peer access to. ``longest`` (the largest count, known on the host) sizes the grid.
    Moved in elements of up to ``word`` bytes (1, 2, 4 or 8: it must divide every address
    in the table). The caller checks every row lies inside its buffer. Enqueued on the
    current stream.
    """
    assert table.dtype == torch.int64 and table.is_contiguous()
    runs = (table.numel() - 2 * num_buffers) // 3
    if runs <= 0 or longest <= 0 or num_buffers <= 0:
        return
    word = max(w for w in _WORDS if row_bytes % w == 0 and word % w == 0)
    width = row_bytes // word
    bases, starts = table[: 2 * num_buffers], table[2 * num_buffers :]
    grid = (runs, triton.cdiv(longest, ROWS), num_buffers)
    _copy_slot_runs_kernel[grid](
        bases[:num_buffers], bases[num_buffers:], starts[:runs], starts[runs : 2 * runs],
        starts[2 * runs :], width,
        WORD=_WORDS[word], ROWS=ROWS, BLOCK_W=min(next_power_of_2(width), 256),
    )  # fmt: skip


def copy_row_runs_ref(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_starts: torch.Tensor,
    dst_starts: torch.Tensor,
    counts: torch.Tensor,
    longest: int,
) -> None:
    """:func:`copy_row_runs` one run at a time (the reference)."""
    for s, d, n in zip(src_starts.tolist(), dst_starts.tolist(), counts.tolist(), strict=True):
        dst[d : d + n] = src[s : s + n]
