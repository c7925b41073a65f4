"""Draft trees (``--speculative-eagle-topk`` > 1): their shape and how a drafter picks one.

A tree hangs off the root, the request's last token (at position ``P``, not yet run by
the target); node ``j`` of depth ``d`` is a guess for position ``P + d``. Nodes are kept
in depth-first preorder, children by falling draft score, so every parent comes before its
children and the first nodes form the best-scored path (a chain is a tree whose nodes all
lie on that path)::

    root ── 0 ── 1 ── 2        parents: [-1, 0, 1, 0, -1]
            │    └─ 3          depths:  [ 1, 2, 3, 2,  1]
            └─ 4
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Candidate", "DraftTree", "select_tree"]

ROOT = -1


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens and, for each, the index of its parent node (``-1``: the root)."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """A chain: each draft follows the one before it."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Each node's depth (a child of the root: 1)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        return depths

    def children(self, node: int) -> list[int]:
        """The children of ``node`` (``-1``: the root), best-scored first."""
        return [j for j, parent in enumerate(self.parents) if parent == node]

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``, inclusive."""
        path: list[int] = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def chain_len(self) -> int:
        """How many first nodes form a chain from the root (all of them for a chain): those
        sit at positions ``P + 1 + j``, in the request's own row."""
        length = 0
        while length < len(self.parents) and self.parents[length] == length - 1:
            length += 1
        return length


class Candidate(NamedTuple):
    """A drafted token: its cumulative draft score (the product of the draft's
    probabilities along its path) and its parent candidate (``-1``: the root)."""

    token: int
    score: float
    parent: int


def select_tree(candidates: Sequence[Candidate], num_nodes: int) -> DraftTree:
    """The ``num_nodes`` best candidates by score (SGLang's rule), as a tree.

    ``candidates`` come step by step (a parent before its children). A child's score is its
    parent's times a probability, never above it; ties go to the earlier candidate, so a
    chosen node's parent is always chosen too.
    """
    order = sorted(range(len(candidates)), key=lambda c: (-candidates[c].score, c))
    chosen = set(order[:num_nodes])
    kids: dict[int, list[int]] = {}
    for c in sorted(chosen, key=lambda c: (-candidates[c].score, c)):
        kids.setdefault(candidates[c].parent, []).append(c)
    tokens: list[int] = []
    parents: list[int] = []
    stack = [(c, ROOT) for c in reversed(kids.get(ROOT, []))]
    while stack:  # depth-first preorder, best child first
        cand, parent_node = stack.pop()
        node = len(tokens)
        tokens.append(candidates[cand].token)
        parents.append(parent_node)
        stack += [(c, node) for c in reversed(kids.get(cand, []))]
    assert len(tokens) == len(chosen), "a chosen candidate's parent was not chosen"
    return DraftTree(tuple(tokens), tuple(parents))
