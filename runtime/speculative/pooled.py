"""Drafters with a model of their own (STANDALONE, EAGLE): a second :class:`ModelRunner`
whose KV pool and request rows the drafter manages per request.

Per request the draft keeps KV for its positions ``0:kv_len``. A step takes the slots it
will write (from position ``kv_len`` on) before its first forward; once the target has
decided, :meth:`PooledDrafter._keep` keeps the positions whose KV stays valid and frees
the whole pages past them::

    draft row:  [ kept KV 0:kv_len | this step's slots ... ]
                                    ^ freed past the new kv_len (whole pages)
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvflow.runtime.core import Req
from kvflow.runtime.cuda_graph import CudaGraphRunner
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.model_runner import ModelRunner
from kvflow.runtime.speculative.base import Drafter
from kvflow.runtime.speculative.batch import build_decode_batch, build_token_batch

__all__ = ["DraftSeq", "PooledDrafter"]


@dataclass
class DraftSeq:
    """One request's state in the draft's pool."""

    row: int
    kv_len: int = 0
    last_loc: int = 0  # slot of position kv_len - 1
    slots: list[int] = field(default_factory=list)  # taken this step, from position kv_len
    seq_len: int = 0  # the request's length when this step drafted
    num_drafts: int = 0


class PooledDrafter(Drafter):
    """The bookkeeping of a draft model's pool; subclasses draft and say what they keep."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        # the draft's decode steps in CUDA graphs (None: eager), captured by the subclass
        # (:mod:`kvflow.runtime.speculative.draft_graphs`)
        self.graphs: CudaGraphRunner | None = None
        self._seqs: dict[int, DraftSeq] = {}  # by id(req)
        self._reqs: dict[int, Req] = {}

    @abstractmethod
    def _new_slots(self, req: Req, seq: DraftSeq, num_drafts: int) -> int:
        """Draft positions this step writes for ``num_drafts`` drafts."""

    def _start(
        self, reqs: Sequence[Req], max_drafts: Sequence[int]
    ) -> list[tuple[int, Req, DraftSeq]]:
        """(index, request, state) of the requests that draft this step, their slots taken
        and ``seq_len`` / ``num_drafts`` set; states of requests gone are dropped."""
        live = {id(r) for r in reqs}
        for key in [k for k in self._seqs if k not in live]:  # left without forget()
            self.forget(self._reqs[key])
        active: list[tuple[int, Req, DraftSeq]] = []
        for i, (req, limit) in enumerate(zip(reqs, max_drafts, strict=True)):
            seq = self._seqs.get(id(req))
            if seq is not None:
                seq.num_drafts = 0
            if limit <= 0 or req.seq_len + limit > self.runner.context_len:
                continue  # (the draft's context may be shorter than the target's)
            seq = self._seq(req)
            if seq is None or not self._take(seq, self._new_slots(req, seq, limit)):
                continue
            seq.seq_len, seq.num_drafts = req.seq_len, limit
            active.append((i, req, seq))
        return active

    def _group_batch(
        self,
        active: Sequence[tuple[int, Req, DraftSeq]],
        group: Sequence[int],
        starts: Sequence[int],
        feed: Sequence[Sequence[int]],
    ) -> ForwardBatch:
        """The draft forward of the requests ``active[k]`` for ``k`` in ``group``: each runs
        ``feed[k]`` from position ``starts[k]`` on, into this step's slots for them. One
        token each (every step after the first) is a decode batch, whose forward replays
        :attr:`graphs` where captured; more is an extend."""
        slots: list[int] = []
        for k in group:
            seq = active[k][2]
            offset = starts[k] - seq.kv_len
            slots += seq.slots[offset : offset + len(feed[k])]
        device = self.runner.device
        rows = [active[k][2].row for k in group]
        loc = torch.tensor(slots, dtype=torch.int64, device=device)
        if all(len(feed[k]) == 1 for k in group):
            tokens = [feed[k][0] for k in group]
            return build_decode_batch(rows, [starts[k] for k in group], tokens, loc, device)
        return build_token_batch(
            rows, [starts[k] for k in group], [feed[k] for k in group], loc, device
        )

    def _graphed(self, fb: ForwardBatch) -> CudaGraphRunner | None:
        """:attr:`graphs` where ``fb`` runs in them (a decode batch they fit), else None."""
        graphs = self.graphs
        return graphs if graphs is not None and graphs.can_run(fb) else None

    def _seq(self, req: Req) -> DraftSeq | None:
        if self._reqs.get(id(req), req) is not req:  # another request at a reused address
            self.forget(self._reqs[id(req)])
        seq = self._seqs.get(id(req))
        if seq is None:
            row = self.runner.req_to_token.alloc()
            if row is None:
                return None
            seq = self._seqs[id(req)] = DraftSeq(row)
            self._reqs[id(req)] = req
        return seq

    def _take(self, seq: DraftSeq, num_new: int) -> bool:
        runner = self.runner
        slots = runner.allocator.alloc_for_request(seq.kv_len, seq.last_loc, num_new)
        if slots is None:
            return False
        on_device = torch.tensor(slots, dtype=torch.int64, device=runner.device)
        runner.req_to_token.write(seq.row, seq.kv_len, on_device)
        seq.slots = slots
        return True

    def _keep(self, seq: DraftSeq, kv_len: int) -> None:
        """The draft's KV is valid below ``kv_len`` (within this step's slots): free the
        pages past it and end the step."""
        start = seq.kv_len
        seq.kv_len = kv_len
        page = self.runner.page_size
        keep_end = -(-kv_len // page) * page
        dead = seq.slots[max(keep_end - start, 0) :]
        if dead:
            self.runner.allocator.free(torch.tensor(dead, dtype=torch.int64))
        if kv_len > start:
            seq.last_loc = seq.slots[kv_len - 1 - start]
        seq.slots, seq.num_drafts = [], 0

    def forget(self, req: Req) -> None:
        seq = self._seqs.pop(id(req), None)
        self._reqs.pop(id(req), None)
        if seq is None:
            return
        end = seq.kv_len + len(seq.slots)
        if end > 0:
            self.runner.allocator.free(self.runner.req_to_token.read(seq.row, end))
        self.runner.req_to_token.free(seq.row)

    def held_tokens(self) -> int:
        allocator = self.runner.allocator
        return allocator.size - allocator.available_size()

    def is_memory_free(self) -> bool:
        runner = self.runner
        return (
            not self._seqs
            and runner.allocator.available_size() == runner.allocator.size
            and runner.req_to_token.available_size() == runner.req_to_token.size
            and runner.req_to_token.spare_available() == runner.req_to_token.spare_rows
        )
