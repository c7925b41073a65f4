"""Draft trees without a model: SGLang's selection of the best-scored candidates, the
greedy walk, the sampled tree rule keeping the target's distribution (seeded draws, a
chi-square bound; a chain drawn exactly as the chain rule draws), and the spare rows."""

from __future__ import annotations

import pytest
import torch

# the chain rule's statistical check: draws, chi-square bound, seeded generators
from test_spec_accept import CHI2_4, DRAWS, _chi2, _generators

from kvflow.runtime.mem import ReqToTokenPool
from kvflow.runtime.speculative.accept import (
    accept_sampled,
    accept_tree_greedy,
    accept_tree_sampled,
)
from kvflow.runtime.speculative.tree import Candidate, DraftTree, select_tree
from kvflow.runtime.speculative.tree_rows import spare_rows


def test_select_tree_keeps_the_best_scored_nodes_in_preorder():
    cands = [
        Candidate(10, 0.5, -1),  # 0: depth 1
        Candidate(11, 0.3, -1),  # 1
        Candidate(12, 0.4, 0),  # 2: depth 2, under 0
        Candidate(13, 0.05, 0),  # 3
        Candidate(14, 0.2, 1),  # 4: under 1
        Candidate(15, 0.1, 1),  # 5
        Candidate(16, 0.35, 2),  # 6: depth 3, under 2
    ]
    tree = select_tree(cands, 5)  # 0.5, 0.4, 0.35, 0.3, 0.2
    assert tree == DraftTree((10, 12, 16, 11, 14), (-1, 0, 1, -1, 3))
    assert tree.depths() == [1, 2, 3, 1, 2]
    assert tree.chain_len() == 3 and tree.children(-1) == [0, 3]
    assert tree.path_to(4) == [3, 4]
    assert select_tree(cands, 0) == DraftTree()
    # equal scores: the earlier candidate (a parent before its child) wins
    tied = [Candidate(1, 1.0, -1), Candidate(2, 1.0, 0), Candidate(3, 1.0, -1)]
    assert select_tree(tied, 2) == DraftTree((1, 2), (-1, 0))
    assert DraftTree.chain([4, 5, 6]).chain_len() == 3


def test_greedy_walk_takes_the_child_the_target_chose():
    tree = DraftTree((10, 12, 16, 11, 14), (-1, 0, 1, -1, 3))
    # target ids after: root, node 0..4
    assert accept_tree_greedy([11, 0, 0, 0, 14, 7], tree) == ([11, 14, 7], [3, 4])
    assert accept_tree_greedy([10, 12, 16, 9, 0, 0], tree) == ([10, 12, 16, 9], [0, 1, 2])
    assert accept_tree_greedy([10, 13, 0, 0, 0, 0], tree) == ([10, 13], [0])
    assert accept_tree_greedy([5, 0, 0, 0, 0, 0], tree) == ([5], [])


def test_sampled_tree_rule_keeps_the_target_distribution():
    # root -> node 0 (token 1) -> node 2 (token 2); root -> node 1 (token 3), a leaf
    tree = DraftTree((1, 3, 2), (-1, -1, 0))
    probs = torch.tensor(
        [
            [0.1, 0.3, 0.2, 0.25, 0.15],  # after the root
            [0.3, 0.1, 0.1, 0.2, 0.3],  # after node 0
            [0.05, 0.05, 0.6, 0.1, 0.2],  # after node 1
            [0.2, 0.2, 0.2, 0.2, 0.2],  # after node 2
        ]
    )
    first = torch.zeros(5)
    second = {1: torch.zeros(5), 3: torch.zeros(5)}
    for seed in range(DRAWS):
        verdict = accept_tree_sampled(probs, tree, _generators(seed))
        first[verdict.tokens[0]] += 1
        if verdict.path:
            assert verdict.tokens[: len(verdict.path)] == [tree.tokens[j] for j in verdict.path]
            second[verdict.tokens[0]][verdict.tokens[1]] += 1
    assert _chi2(first, probs[0]) < CHI2_4, first
    assert _chi2(second[1], probs[1]) < CHI2_4, second[1]  # node 0's row
    assert _chi2(second[3], probs[2]) < CHI2_4, second[3]  # node 1's row (a leaf)


def test_sampled_tree_rule_on_a_chain_draws_as_the_chain_rule():
    probs = torch.softmax(torch.randn(4, 7, generator=torch.Generator().manual_seed(2)), -1)
    draft = [3, 1, 5]
    for seed in range(200):
        chain = accept_sampled(probs, draft, _generators(seed))
        tree = accept_tree_sampled(probs, DraftTree.chain(draft), _generators(seed))
        assert tree.tokens == chain.tokens and len(tree.path) == chain.num_accepted


def test_spare_rows_hold_the_prefix_and_the_path_and_come_back():
    pool = ReqToTokenPool(2, 16, "cpu", spare_rows=3)
    pool.write(0, 0, torch.arange(100, 106))
    with spare_rows(pool) as spare:
        rows = spare.take(0, 4, 2)
        assert rows is not None and all(r >= pool.size for r in rows)
        spare.write_paths(rows, [4, 4], [[7], [8, 9]])
        assert pool.read(rows[0], 5).tolist() == [100, 101, 102, 103, 7]
        assert pool.read(rows[1], 6).tolist() == [100, 101, 102, 103, 8, 9]
        assert spare.take(0, 4, 2) is None  # one left
        assert pool.alloc() is not None and pool.alloc() is not None and pool.alloc() is None
    assert pool.spare_available() == 3
    with pytest.raises(RuntimeError), spare_rows(pool) as spare:
        spare.take(1, 2, 3)
        raise RuntimeError("a failed forward")
    assert pool.spare_available() == 3
