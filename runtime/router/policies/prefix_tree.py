"""An approximate radix tree of the prompts routed to one worker, bounded with LRU eviction.

"Approximate" because the router cannot see the worker's real cache: the tree holds what
the router sent there, and evicts on its own size bound, not on the worker's. Keys are
strings: prompt text, or token ids mapped one id per character (see ``prompt.py``).

::

    root ── "You are a helpful" ─┬─ " assistant. Hi"          (leaf, last used t=7)
                                 └─ " bot. What is 2+2?"      (leaf, last used t=9)

Edges carry label strings; ``size`` is the sum of label lengths (characters stored).
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

__all__ = ["PrefixMatch", "PrefixTree"]


class _Node:
    __slots__ = ("children", "label", "last_used", "parent")

    def __init__(self, label: str, parent: _Node | None, last_used: int) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.last_used = last_used


class PrefixMatch(NamedTuple):
    matched: int  # characters of the key found in the tree
    total: int  # characters in the key

    @property
    def ratio(self) -> float:
        return self.matched / self.total if self.total else 0.0


def _shared(label: str, key: str, pos: int) -> int:
    """Length of the common prefix of ``label`` and ``key[pos:]``.

    Comparisons run in C (``str.startswith`` with an offset): a whole edge at once, which is
    the common case along a cached path, else a binary search for where they part, copying
    at most ``len(label)`` characters in all. A character-by-character Python loop cost
    ~0.6 ms per 1,200-character prompt over four trees.
    """
    if key.startswith(label, pos):
        return len(label)
    lo, hi = 0, min(len(label), len(key) - pos)  # label[:lo] matches; the answer is <= hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key.startswith(label[lo:mid], pos + lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """Insert keys, match prefixes; evict least recently used leaves past ``max_size``.

    Eviction runs when an insert passes ``max_size`` and goes down to 90% of it, so its
    sort over the leaves is paid once per many inserts.
    """

    def __init__(self, max_size: int) -> None:
        if max_size <= 0:
            raise ValueError("max_size must be positive")
        self.max_size = max_size
        self.size = 0
        self._root = _Node("", None, 0)
        self._clock = 0

    def match(self, key: str) -> PrefixMatch:
        """Longest prefix of ``key`` in the tree; marks the path as used."""
        self._clock += 1
        node, pos = self._root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            shared = _shared(child.label, key, pos)
            child.last_used = self._clock
            pos += shared
            if shared < len(child.label):
                break
            node = child
        return PrefixMatch(pos, len(key))

    def insert(self, key: str) -> None:
        """Add ``key`` (splitting an edge where it diverges), then evict if over the bound."""
        self._clock += 1
        node, pos = self._root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                node.children[key[pos]] = _Node(key[pos:], node, self._clock)
                self.size += len(key) - pos
                break
            shared = _shared(child.label, key, pos)
            child.last_used = self._clock
            if shared < len(child.label):
                # split: node -> middle(label[:shared]) -> child(label[shared:])
                middle = _Node(child.label[:shared], node, self._clock)
                node.children[key[pos]] = middle
                child.label = child.label[shared:]
                child.parent = middle
                middle.children[child.label[0]] = child
                child = middle
            pos += shared
            node = child
        if self.size > self.max_size:
            self._evict(int(self.max_size * 0.9))

    def _evict(self, target: int) -> None:
        leaves = [n for n in self._nodes() if not n.children and n is not self._root]
        heap = [(n.last_used, i, n) for i, n in enumerate(leaves)]
        heapq.heapify(heap)
        seq = len(heap)
        while self.size > target and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.label[0]]
            self.size -= len(leaf.label)
            # a parent left childless is a leaf now: it goes in its turn if needed
            if parent is not self._root and not parent.children:
                seq += 1
                heapq.heappush(heap, (parent.last_used, seq, parent))

    def _nodes(self) -> list[_Node]:
        stack, out = [self._root], []
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
