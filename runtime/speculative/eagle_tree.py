"""EAGLE tree drafting (``--speculative-eagle-topk K`` > 1), SGLang's rule: the head's
top-K after the root are the first candidates and the frontier; each further step runs the
frontier (K nodes per request, one forward for all) and takes each node's top-K children,
all K*K of them candidates scored by the product of the head's probabilities along their
path, the K best the next frontier. After ``--speculative-num-steps`` levels the
``--speculative-num-draft-tokens - 1`` best candidates form the tree
(:func:`~kvflow.runtime.speculative.tree.select_tree`).

The catch-up is the chain's (:mod:`~kvflow.runtime.speculative.eagle`): the head's KV
below ``L - 1`` is all that stays. A frontier node of depth ``d`` runs at head position
``L - 2 + d`` in a spare row of the head's ``req_to_token`` holding the request's head KV
``0:L-1``, then its ancestors' slots and its own (:mod:`~kvflow.runtime.speculative.
tree_rows`), so it attends to its own branch only; those slots and rows are given back
before :meth:`EagleTreeDrafter.propose_trees` returns.

A frontier's forward is a decode batch (one token per node, in the node's spare row), so
on CUDA it replays the head's CUDA graphs, captured for ``topk`` rows per running request
(:mod:`~kvflow.runtime.speculative.draft_graphs`); the catch-up is the chain's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvflow.runtime.config import EngineConfig
from kvflow.runtime.core import Req
from kvflow.runtime.model_runner import ModelRunner
from kvflow.runtime.speculative.base import Drafter, TreeDrafter
from kvflow.runtime.speculative.batch import build_decode_batch
from kvflow.runtime.speculative.eagle import EagleDrafter
from kvflow.runtime.speculative.pooled import DraftSeq
from kvflow.runtime.speculative.tree import ROOT, Candidate, DraftTree, select_tree
from kvflow.runtime.speculative.tree_rows import SpareRows, spare_rows

__all__ = ["EagleTreeDrafter", "make_eagle_drafter"]


def make_eagle_drafter(config: EngineConfig, target: ModelRunner) -> Drafter:
    """EAGLE's and EAGLE3's drafter: chains, or trees with ``--speculative-eagle-topk`` > 1."""
    if config.speculative_eagle_topk > 1:
        return EagleTreeDrafter(config, target)
    return EagleDrafter(config, target)


@dataclass
class _Node:
    """A node whose children the head has scored or is to score: its candidate (``-1``:
    the root), its feature (a row of the head's last output) and the head slots of its
    path (its ancestors', then its own once it has run)."""

    cand: int
    feature: int
    path: list[int] = field(default_factory=list)


@dataclass
class _Growth:
    """One request's tree while it grows."""

    seq: DraftSeq
    depth_limit: int
    cands: list[Candidate] = field(default_factory=list)
    frontier: list[_Node] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # spare head rows, one per frontier node


class EagleTreeDrafter(EagleDrafter, TreeDrafter):
    """Draft trees from an EAGLE or EAGLE-3 head (page size 1)."""

    def __init__(self, config: EngineConfig, target: ModelRunner) -> None:
        self.topk = config.speculative_eagle_topk
        self.num_steps = config.speculative_num_steps
        self.max_nodes = config.speculative_num_draft_tokens - 1
        spare = config.max_running_requests * self.topk
        super().__init__(config, target, spare_rows=spare, graph_rows=self.topk)

    def _new_slots(self, req: Req, seq: DraftSeq, num_drafts: int) -> int:
        return req.seq_len - 1 - seq.kv_len  # the catch-up's; the branches' come per step

    def propose(self, reqs: Sequence[Req], max_drafts: Sequence[int]) -> list[list[int]]:
        """The best-scored path of each tree (the verify step calls :meth:`propose_trees`)."""
        trees = self.propose_trees(reqs, max_drafts)
        return [[tree.tokens[j] for j in range(tree.chain_len())] for tree in trees]

    @torch.inference_mode()
    def propose_trees(self, reqs: Sequence[Req], max_depths: Sequence[int]) -> list[DraftTree]:
        trees = [DraftTree() for _ in reqs]
        active = self._start(reqs, max_depths)
        if not active:
            return trees
        growths = [_Growth(seq, min(self.num_steps, max_depths[i])) for i, _, seq in active]
        hidden = self._catch_up(active)
        self._expand(growths, hidden, [(g, _Node(ROOT, g)) for g in range(len(growths))])
        branch_slots: list[int] = []
        try:
            with spare_rows(self.runner.req_to_token) as spare:
                for depth in range(1, self.num_steps):
                    ran = self._run_frontier(growths, depth, hidden, spare, branch_slots)
                    if ran is None:
                        break
                    hidden, nodes = ran
                    self._expand(growths, hidden, nodes)
        finally:
            if branch_slots:
                self.runner.allocator.free(torch.tensor(branch_slots, dtype=torch.int64))
        for (i, _, seq), growth in zip(active, growths, strict=True):
            trees[i] = select_tree(growth.cands, self.max_nodes)
            self._keep(seq, seq.seq_len - 1)  # the catch-up's KV stays, as a chain's
        return trees

    def _catch_up(self, active: Sequence[tuple[int, Req, DraftSeq]]) -> torch.Tensor:
        """The head over the tokens it has not seen, with the target's features: its output
        at each request's last position ``L - 2``, ``[A, hidden]``."""
        feed = [req.all_token_ids()[seq.kv_len + 1 : req.seq_len] for _, req, seq in active]
        starts = [seq.kv_len for _, _, seq in active]
        fb = self._group_batch(active, range(len(active)), starts, feed)
        fb.input_hidden = torch.cat([self._features(req, seq) for _, req, seq in active])
        return self._head_out(fb)

    def _expand(
        self, growths: Sequence[_Growth], hidden: torch.Tensor, nodes: list[tuple[int, _Node]]
    ) -> None:
        """``hidden[r]``: the head's output at node ``nodes[r]`` of tree ``growths[g]``. Its
        top-K children become candidates; each tree's K best new ones its next frontier
        (their feature: their parent's output, ``hidden[r]``)."""
        probs, ids = self.head.draft_topk(hidden, self.topk)
        made: dict[int, list[tuple[float, int, _Node]]] = {}  # tree -> (score, cand, parent)
        for (g, node), row_probs, row_ids in zip(nodes, probs.tolist(), ids.tolist(), strict=True):
            cands = growths[g].cands
            base = 1.0 if node.cand == ROOT else cands[node.cand].score
            for p, token in zip(row_probs, row_ids, strict=True):
                made.setdefault(g, []).append((base * p, len(cands), node))
                cands.append(Candidate(token, base * p, node.cand))
        for g, new in made.items():
            best = sorted(new, key=lambda m: (-m[0], m[1]))[: self.topk]
            growths[g].frontier = [
                _Node(cand, parent.feature, parent.path) for _, cand, parent in best
            ]

    def _run_frontier(
        self,
        growths: Sequence[_Growth],
        depth: int,
        hidden: torch.Tensor,
        spare: SpareRows,
        branch_slots: list[int],
    ) -> tuple[torch.Tensor, list[tuple[int, _Node]]] | None:
        """One head forward over the frontier nodes (depth ``depth``, features rows of
        ``hidden``) of every tree that grows deeper: their outputs and the nodes, or None
        when no tree does. A tree without head slots or spare rows left stops growing. The
        forward is a decode batch: node ``r`` at position ``start + depth - 1`` of its row,
        which holds the prefix and its path (replayed in the head's graphs where it fits;
        the output is then the graph's, valid until the next replay)."""
        runner = self.runner
        nodes: list[tuple[int, _Node]] = []
        rows: list[int] = []
        for g, growth in enumerate(growths):
            frontier, growth.frontier = growth.frontier, []
            if depth >= growth.depth_limit or not frontier:
                continue
            if not growth.rows:
                start = growth.seq.seq_len - 1
                growth.rows = spare.take(growth.seq.row, start, self.topk) or []
            taken = runner.allocator.alloc_for_request(0, 0, len(frontier))
            if taken is None or len(growth.rows) < len(frontier):
                if taken is not None:
                    runner.allocator.free(torch.tensor(taken, dtype=torch.int64))
                continue
            branch_slots += taken
            for node, row, slot in zip(frontier, growth.rows, taken, strict=False):
                node.path = [*node.path, slot]
                nodes.append((g, node))
                rows.append(row)
        if not nodes:
            return None
        starts = [growths[g].seq.seq_len - 1 for g, _ in nodes]
        spare.write_paths(rows, starts, [node.path for _, node in nodes])
        device = runner.device
        fb = build_decode_batch(
            rows,
            [start + depth - 1 for start in starts],
            [growths[g].cands[node.cand].token for g, node in nodes],
            torch.tensor([node.path[-1] for _, node in nodes], dtype=torch.int64, device=device),
            device,
        )
        fb.input_hidden = hidden[[node.feature for _, node in nodes]]  # (a copy)
        out = self._head_out(fb)
        return out, [(g, _Node(node.cand, r, node.path)) for r, (g, node) in enumerate(nodes)]
