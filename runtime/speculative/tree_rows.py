"""Rows of ``req_to_token`` for the nodes of draft trees: with them a decode row (or a
one-token extend) attends to exactly a node's ancestors, no tree mask needed.

A node of depth ``d`` under a request whose row holds positions ``0:start`` gets a spare
row holding the same slots, then the slots of its ancestors and its own::

    request row:  [ slots 0 .. start-1 | ... ]
    node row:     [ slots 0 .. start-1 | ancestor 1 .. ancestor d-1 | own ]   (copied
                    from the request row)                                      per node)

With ``seq_len = start + d`` the attention of the node's row sees the prefix and its
path, nothing of its siblings. Only slot numbers are written, no KV is copied.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch

from kvflow.runtime.core import Req
from kvflow.runtime.mem import ReqToTokenPool
from kvflow.runtime.speculative.tree import DraftTree

__all__ = ["SpareRows", "VerifyRows", "spare_rows", "verify_rows"]


class SpareRows:
    """Spare rows taken for one scope (:func:`spare_rows` gives them back on exit)."""

    def __init__(self, pool: ReqToTokenPool) -> None:
        self.pool = pool
        self.taken: list[int] = []
        self._copies: list[tuple[int, int]] = []  # (spare row, its base row) not yet copied
        self._copy_len = 0

    def take(self, base_row: int, start: int, count: int) -> list[int] | None:
        """``count`` rows to hold ``base_row``'s slots of positions ``0:start`` (None,
        nothing taken, when too few are spare). The copies are queued: the next
        :meth:`write_paths` runs them all first, as one gather and scatter."""
        rows = self.pool.spare(count)
        if rows is None or not rows:
            return rows
        self.taken += rows
        self._copies += [(row, base_row) for row in rows]
        self._copy_len = max(self._copy_len, start)
        return rows

    def write_paths(
        self, rows: Sequence[int], starts: Sequence[int], paths: Sequence[Sequence[int]]
    ) -> None:
        """Row ``rows[i]`` holds slots ``paths[i]`` at positions ``starts[i]`` on (one
        scatter for all of them), after the queued copies of base rows."""
        table = self.pool.req_to_token
        if self._copies:
            # NOTE: every row copies the longest prefix queued: past its own ``start`` it
            # gets its base row's later slots, which its path overwrites or which lie past
            # its ``seq_len`` (never read); one copy for the batch instead of one per request
            spare, base = zip(*self._copies, strict=True)
            index = torch.tensor([spare, base], dtype=torch.int64, device=table.device)
            table[index[0], : self._copy_len] = table[index[1], : self._copy_len]
            self._copies, self._copy_len = [], 0
        row_len = table.shape[1]
        flat: list[int] = []
        slots: list[int] = []
        for row, start, path in zip(rows, starts, paths, strict=True):
            flat += range(row * row_len + start, row * row_len + start + len(path))
            slots += path
        if flat:
            index = torch.tensor(flat, dtype=torch.int64, device=table.device)
            values = torch.tensor(slots, dtype=table.dtype, device=table.device)
            table.view(-1).index_copy_(0, index, values)


@contextmanager
def spare_rows(pool: ReqToTokenPool) -> Iterator[SpareRows]:
    """Spare rows for one forward (or one draft step): all given back on exit, raised or
    not, so none outlives the step."""
    rows = SpareRows(pool)
    try:
        yield rows
    finally:
        pool.free_spare(rows.taken)


class VerifyRows(NamedTuple):
    """A verify batch's rows (:func:`kvflow.runtime.speculative.batch.build_decode_batch`),
    request by request: the root, then each node in order."""

    pool_rows: list[int]
    positions: list[int]
    input_ids: list[int]


def verify_rows(
    reqs: Sequence[Req], trees: Sequence[DraftTree], taken: Sequence[list[int]], spare: SpareRows
) -> VerifyRows:
    """The rows verifying request i's last token (position ``kv_len``) and ``trees[i]``,
    whose KV slots ``taken[i]`` (the root's, then node j's at ``1 + j``) the request's row
    holds from ``kv_len`` on. The root and the tree's leading chain read the request's row;
    every other node a spare row with its ancestors (raises RuntimeError when too few are
    spare: the pool reserves one per draft token of every running request)."""
    out = VerifyRows([], [], [])
    node_rows: list[int] = []
    starts: list[int] = []
    paths: list[list[int]] = []
    for req, tree, slots in zip(reqs, trees, taken, strict=True):
        prefix_len, row = req.kv_len, req.req_pool_idx
        chain_len = tree.chain_len()
        branch_rows = spare.take(row, prefix_len + 1, len(tree) - chain_len)
        if branch_rows is None:
            raise RuntimeError(f"no spare req_to_token rows for {req.rid}'s draft tree")
        for j in range(chain_len, len(tree)):
            starts.append(prefix_len + 1)
            paths.append([slots[1 + a] for a in tree.path_to(j)])
        node_rows += branch_rows
        out.pool_rows.extend([row] * (1 + chain_len) + branch_rows)
        out.positions.extend([prefix_len, *(prefix_len + d for d in tree.depths())])
        out.input_ids.extend([req.all_token_ids()[prefix_len], *tree.tokens])
    spare.write_paths(node_rows, starts, paths)
    return out
