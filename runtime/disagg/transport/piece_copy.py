"""A transfer plan's pieces (thousands of small ``Write``s) as a few gathers and scatters.

A KV plan writes, per layer, K and V runs of slots from one pool into another: thousands of
pieces of a few KiB each. Copying them one call per piece costs microseconds of launch each;
grouped by (source buffer, destination buffer) pair and cut into rows of their greatest
common size, every pair is one kernel however many pieces it has: on one CUDA device
:func:`~kvflow.kernels.row_runs.copy_row_runs` (each run of rows copied in one pass),
elsewhere an ``index_select`` and an ``index_copy_`` over the expanded rows.

:func:`unit_indices` is the pure part (addresses in, unit indices out, numpy);
:func:`copy_pieces` runs it over byte tensors of any device.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvflow.kernels.row_runs import copy_row_runs
from kvflow.runtime.disagg.plan import Write
from kvflow.runtime.disagg.transport.base import TransferError

__all__ = ["Buffers", "PairCopy", "copy_pieces", "unit_indices"]


class Buffers(NamedTuple):
    """Byte buffers by the addresses writes name them with: ``addrs[i]`` is where
    ``tensors[i]`` (1-D ``uint8``) starts in the plan's address space."""

    addrs: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(t.numel() for t in self.tensors)


class PairCopy(NamedTuple):
    """The runs one (source buffer, destination buffer) pair copies, in rows of ``unit``
    bytes: run ``i`` is ``counts[i]`` rows from source row ``src_starts[i]`` to destination
    row ``dst_starts[i]``."""

    src: int
    dst: int
    unit: int
    src_starts: np.ndarray
    dst_starts: np.ndarray
    counts: np.ndarray

    def units(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row copied: (source rows, destination rows)."""
        steps = np.arange(int(self.counts.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(self.counts) - self.counts, self.counts
        )
        return (
            np.repeat(self.src_starts, self.counts) + steps,
            np.repeat(self.dst_starts, self.counts) + steps,
        )


def _locate(
    ptrs: np.ndarray, nbytes: np.ndarray, addrs: Sequence[int], sizes: Sequence[int], side: str
) -> tuple[np.ndarray, np.ndarray]:
    """Each piece's buffer and offset in it; a piece outside every buffer is an error."""
    order = np.argsort(np.asarray(addrs, dtype=np.int64))
    bases = np.asarray(addrs, dtype=np.int64)[order]
    ends = bases + np.asarray(sizes, dtype=np.int64)[order]
    where = np.searchsorted(bases, ptrs, side="right") - 1
    inside = (where >= 0) & (ptrs + nbytes <= ends[np.maximum(where, 0)])
    if not inside.all():
        bad = int(np.argmin(inside))
        raise TransferError(
            f"a {int(nbytes[bad])}-byte piece at {int(ptrs[bad]):#x} lies outside every "
            f"{side} buffer"
        )
    return order[where], ptrs - bases[where]


def unit_indices(
    writes: Sequence[Write],
    src_addrs: Sequence[int],
    src_sizes: Sequence[int],
    dst_addrs: Sequence[int],
    dst_sizes: Sequence[int],
) -> list[PairCopy]:
    """The pieces of ``writes`` grouped by buffer pair, as runs of rows of the largest size
    that divides every offset and length of the pair (a KV plan: a slot's bytes)."""
    if not writes:
        return []
    # NOTE: fromiter over the flattened tuples: np.asarray of 16k NamedTuples took 8 ms
    flat = np.fromiter(itertools.chain.from_iterable(writes), dtype=np.int64, count=3 * len(writes))
    src_ptr, dst_ptr, nbytes = flat.reshape(-1, 3).T
    if (nbytes <= 0).any():
        raise TransferError("a piece of a KV write has no bytes")
    src_buf, src_off = _locate(src_ptr, nbytes, src_addrs, src_sizes, "source")
    dst_buf, dst_off = _locate(dst_ptr, nbytes, dst_addrs, dst_sizes, "destination")
    pairs = src_buf * len(dst_addrs) + dst_buf
    order = np.argsort(pairs, kind="stable")  # pieces grouped by pair, plan order kept
    keys = pairs[order]
    bounds = np.flatnonzero(np.diff(keys)) + 1
    copies = []
    for group in np.split(order, bounds):
        pair = int(pairs[group[0]])
        s_off, d_off, n = src_off[group], dst_off[group], nbytes[group]
        unit = math.gcd(int(np.gcd.reduce(s_off)), int(np.gcd.reduce(d_off)), int(np.gcd.reduce(n)))
        copies.append(
            PairCopy(
                pair // len(dst_addrs),
                pair % len(dst_addrs),
                unit,
                s_off // unit,
                d_off // unit,
                n // unit,
            )
        )
    return copies


_WORDS = (torch.int64, torch.int32, torch.int16)


def _rows(buffer: torch.Tensor, unit: int) -> torch.Tensor:
    """``buffer``'s bytes as rows of ``unit`` bytes, in the widest integer type that divides
    the unit and the buffer's address (index kernels move elements: 8-byte words copy 8x
    fewer than bytes)."""
    rows = buffer[: buffer.numel() // unit * unit].view(-1, unit)
    for word in _WORDS:
        size = word.itemsize
        if unit % size == 0 and buffer.data_ptr() % size == 0:
            return rows.view(word)
    return rows


def copy_pieces(writes: Sequence[Write], src: Buffers, dst: Buffers) -> int:
    """Copy every piece of ``writes`` from ``src`` into ``dst`` (on the current stream of
    the source's device; a destination on another device gets one extra copy per pair).
    Returns the bytes copied. Enqueued only: the caller synchronizes."""
    pairs = unit_indices(writes, src.addrs, src.sizes, dst.addrs, dst.sizes)
    if not pairs:
        return 0
    device = src.tensors[pairs[0].src].device
    runs = _runs_on(pairs, device) if device.type == "cuda" else None  # the kernel's input
    copied = first = 0
    for pair in pairs:
        source, target = src.tensors[pair.src], dst.tensors[pair.dst]
        last = first + len(pair.counts)
        src_rows, dst_rows = _rows(source, pair.unit), _rows(target, pair.unit)
        if runs is not None and target.device == source.device:
            longest = int(pair.counts.max())
            copy_row_runs(src_rows, dst_rows, *runs[:, first:last], longest=longest)
        else:  # CPU, or another device: gather and scatter the expanded rows
            picked, placed = (torch.from_numpy(rows) for rows in pair.units())
            gathered = src_rows.index_select(0, picked.to(source.device))
            if gathered.device != target.device:
                gathered = gathered.to(target.device, non_blocking=True)
            dst_rows.index_copy_(0, placed.to(target.device), gathered)
        copied += int(pair.counts.sum()) * pair.unit
        first = last
    return copied


def _runs_on(pairs: list[PairCopy], device: torch.device) -> torch.Tensor:
    """Every pair's runs, one after another, as ``[3, runs]`` (source starts, destination
    starts, counts) on ``device``: one host-to-device copy per write, from pinned memory on
    CUDA (a pageable copy would wait for the stream's earlier work)."""
    runs = np.concatenate([np.stack([p.src_starts, p.dst_starts, p.counts]) for p in pairs], axis=1)
    host = torch.from_numpy(np.ascontiguousarray(runs))
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
