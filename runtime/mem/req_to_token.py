"""First level of KV memory: which KV slot holds each token of each running request."""

from __future__ import annotations

import mmap

import torch

__all__ = ["ReqToTokenPool"]


class ReqToTokenPool:
    """A table ``req_to_token[req_pool_idx, position] -> KV slot`` plus a free list of rows.

    A request takes one row when it is scheduled and gives it back when it finishes, is
    retracted or aborted. The table's int32 rows are what attention kernels read.

    ``spare_rows`` more rows follow the ``size`` request rows, handed out only by
    :meth:`spare` for the length of one forward (a draft tree's nodes, each attending to
    its own ancestors: ``kvflow.runtime.speculative.tree_rows``)::

        rows:  [ 0 .. size)  requests (alloc/free)  |  [size .. size + spare_rows)  spare
    """

    def __init__(self, size: int, max_context_len: int, device: str, spare_rows: int = 0) -> None:
        self.size = size
        self.spare_rows = spare_rows
        self.max_context_len = max_context_len
        rows = size + spare_rows
        if torch.device(device).type == "cpu":
            # NOTE: as the CPU KV pool (kv_pool.py): an anonymous mapping, whose pages the
            # kernel hands out zeroed when first written, so an idle server does not hold
            # the whole table (256 rows of the context length: 8 MB for SmolLM2)
            self._mapping = mmap.mmap(-1, rows * max_context_len * 4)
            table = torch.frombuffer(self._mapping, dtype=torch.int32)
            self.req_to_token = table.view(rows, max_context_len)
        else:
            self.req_to_token = torch.zeros(
                (rows, max_context_len), dtype=torch.int32, device=device
            )
        self._free_slots = list(range(self.size - 1, -1, -1))
        self._free_spare = list(range(rows - 1, size - 1, -1))

    def available_size(self) -> int:
        return len(self._free_slots)

    def alloc(self) -> int | None:
        return self._free_slots.pop() if self._free_slots else None

    def free(self, req_pool_idx: int) -> None:
        if req_pool_idx in self._free_slots:
            raise RuntimeError(f"request slot {req_pool_idx} freed twice")
        self._free_slots.append(req_pool_idx)

    def spare_available(self) -> int:
        return len(self._free_spare)

    def spare(self, count: int) -> list[int] | None:
        """``count`` spare rows (None, nothing taken, if fewer are free); the caller gives
        them back with :meth:`free_spare` once the forward that reads them has run."""
        if count > len(self._free_spare):
            return None
        rows = self._free_spare[len(self._free_spare) - count :]
        del self._free_spare[len(self._free_spare) - count :]
        return rows

    def free_spare(self, rows: list[int]) -> None:
        self._free_spare += rows

    def write(self, req_pool_idx: int, start: int, kv_indices: torch.Tensor) -> None:
        """Record that positions ``start:start+len(kv_indices)`` live at ``kv_indices``."""
        end = start + kv_indices.numel()
        self.req_to_token[req_pool_idx, start:end] = kv_indices.to(torch.int32)

    def read(self, req_pool_idx: int, end: int, start: int = 0) -> torch.Tensor:
        """The KV slots of positions ``start:end`` (int64, ready for indexing)."""
        return self.req_to_token[req_pool_idx, start:end].to(torch.int64)
