"""``cache_aware``: send a prompt where its prefix is likely cached, unless load is skewed.

SGLang router's algorithm, one tree per worker:

1. Imbalanced (``max - min > balance_abs_threshold`` and ``max > min *
   balance_rel_threshold`` over the candidates' loads): the least loaded worker.
2. Otherwise the worker whose tree matches the longest prefix, if matched / prompt length
   reaches ``cache_threshold``; below it, the worker with the smallest tree (the most room
   for a new prefix), ties broken by load.

The chosen worker's tree then learns the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.runtime.router.config import CacheAwareConfig, RouterConfig
from kvflow.runtime.router.policies.base import Policy, Selection
from kvflow.runtime.router.policies.prefix_tree import PrefixTree
from kvflow.runtime.router.worker import Worker

__all__ = ["CacheAwarePolicy"]


class CacheAwarePolicy(Policy):
    needs_key = True

    def __init__(self, config: RouterConfig | CacheAwareConfig | None = None) -> None:
        if isinstance(config, RouterConfig):
            config = config.cache_aware
        self.config = config or CacheAwareConfig()
        self.trees: dict[str, PrefixTree] = {}

    def _tree(self, url: str) -> PrefixTree:
        tree = self.trees.get(url)
        if tree is None:
            tree = self.trees[url] = PrefixTree(self.config.max_tree_size)
        return tree

    def _imbalanced(self, candidates: Sequence[Worker]) -> bool:
        loads = [w.load for w in candidates]
        high, low = max(loads), min(loads)
        return (
            high - low > self.config.balance_abs_threshold
            and high > low * self.config.balance_rel_threshold
        )

    def select(self, candidates: Sequence[Worker], key: str) -> Selection:
        ratio: float | None = None
        if len(candidates) > 1 and self._imbalanced(candidates):
            chosen = min(candidates, key=lambda w: w.load)
        else:
            best, best_len = candidates[0], -1
            for worker in candidates:
                matched = self._tree(worker.url).match(key).matched
                if matched > best_len:
                    best, best_len = worker, matched
            ratio = best_len / len(key) if key else 0.0
            if key and ratio >= self.config.cache_threshold:
                chosen = best
            else:
                chosen = min(candidates, key=lambda w: (self._tree(w.url).size, w.load))
        if key:
            self._tree(chosen.url).insert(key)
        return Selection(chosen, ratio)

    def forget(self, url: str) -> None:
        self.trees.pop(url, None)
