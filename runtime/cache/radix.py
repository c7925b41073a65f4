"""RadixCache: a radix tree from token ids to KV slots, with lock references and LRU eviction.

Tree shape (page_size 1; with pages every edge is a whole number of pages)::

    root --[1,2,3]--> A --[4,5]--> B        B.value = KV slots of tokens 4,5
                       \\--[9]----> C        A.lock_ref counts requests whose prefix ends in A's subtree

Each ``extra_key`` (adapter name, cache salt) has a root of its own, so namespaces never
share entries. ``lock_ref > 0`` protects a node and, because locking walks to the root,
all its ancestors. Only unlocked leaves are evicted, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Any

import torch

from kvflow.runtime.cache.base import MatchResult, PrefixCache

if TYPE_CHECKING:
    from kvflow.runtime.core import Req
    from kvflow.runtime.mem import ReqToTokenPool, TokenToKVPoolAllocator

__all__ = ["RadixCache", "TreeNode"]

_ids = itertools.count()


class TreeNode:
    """One edge of the tree: ``key`` token ids and their KV slots ``value`` (int64)."""

    __slots__ = ("children", "id", "key", "last_access", "lock_ref", "parent", "value")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[Any, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.id = next(_ids)

    def __lt__(self, other: TreeNode) -> bool:  # heap order: LRU first, then creation
        return (self.last_access, self.id) < (other.last_access, other.id)


class RadixCache(PrefixCache):
    """Prefix matching on page-aligned token ids, node splitting, locks and LRU eviction."""

    def __init__(self, req_to_token: ReqToTokenPool, allocator: TokenToKVPoolAllocator) -> None:
        super().__init__(req_to_token, allocator)
        self.reset()

    # -- tree primitives ------------------------------------------------------------------
    def _new_node(self, key: list[int], value: Any, parent: TreeNode | None) -> TreeNode:
        return TreeNode(key, value, parent)

    def reset(self) -> None:
        self._roots: dict[str | None, TreeNode] = {}
        self._evictable = 0
        self._protected = 0
        self._clock = 0

    def _root(self, extra_key: str | None) -> TreeNode:
        root = self._roots.get(extra_key)
        if root is None:
            root = self._new_node([], torch.empty(0, dtype=torch.int64), None)
            root.lock_ref = 1  # roots are never evicted
            self._roots[extra_key] = root
        return root

    def _edge(self, key: list[int]) -> Any:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _common_len(self, a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n - n % self.page_size

    def _touch(self, node: TreeNode) -> None:
        self._clock += 1
        node.last_access = self._clock

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        assert child.parent is not None
        head = self._new_node(child.key[:at], child.value[:at], child.parent)
        head.lock_ref, head.last_access = child.lock_ref, child.last_access
        child.parent.children[self._edge(head.key)] = head
        child.key, child.value, child.parent = child.key[at:], child.value[at:], head
        head.children[self._edge(child.key)] = child
        return head

    def _aligned(self, token_ids: list[int]) -> list[int]:
        return token_ids[: len(token_ids) - len(token_ids) % self.page_size]

    def match_prefix(self, token_ids: list[int], extra_key: str | None = None) -> MatchResult:
        path = self._match_path(token_ids, extra_key)
        values = [node.value for node in path]
        kv = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return MatchResult(kv, path[-1] if path else self._root(extra_key))

    def _match_path(self, token_ids: list[int], extra_key: str | None) -> list[TreeNode]:
        """The nodes from the root's child down that ``token_ids`` (page-aligned) matches,
        each touched; the last one is split where the match ends inside it."""
        key = self._aligned(token_ids)
        node = self._root(extra_key)
        path: list[TreeNode] = []
        while key:
            child = node.children.get(self._edge(key))
            if child is None:
                break
            self._touch(child)
            n = self._common_len(child.key, key)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            path.append(child)
            node, key = child, key[n:]
        return path

    def insert(
        self, token_ids: list[int], kv_indices: torch.Tensor, extra_key: str | None = None
    ) -> int:
        """Insert ``token_ids -> kv_indices``; return how many leading tokens were already cached.

        The caller still owns ``kv_indices[:returned]`` and must free the ones it does not
        share with the tree.
        """
        key = self._aligned(token_ids)
        value = kv_indices[: len(key)]
        node = self._root(extra_key)
        already = 0
        while key:
            child = node.children.get(self._edge(key))
            if child is None:
                leaf = self._new_node(list(key), value.clone(), node)
                self._touch(leaf)
                node.children[self._edge(key)] = leaf
                self._evictable += len(key)
                break
            self._touch(child)
            n = self._common_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            already += n
            node, key, value = child, key[n:], value[n:]
        return already

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("radix node unlocked more often than locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    def _leaves(self) -> list[TreeNode]:
        leaves, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            if not node.children and node.parent is not None:
                leaves.append(node)
            stack.extend(node.children.values())
        return leaves

    def evict(self, num_tokens: int) -> int:
        heap = [leaf for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self.allocator.free(leaf.value)
            del parent.children[self._edge(leaf.key)]
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            if not parent.children and parent.parent is not None and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # -- request hooks --------------------------------------------------------------------
    def _insert_req(self, req: Req) -> tuple[torch.Tensor, int]:
        """Insert the request's KV; free its duplicates. Returns (its slots, aligned length)."""
        kv = self.req_to_token.read(req.req_pool_idx, req.kv_len)
        tokens = req.all_token_ids()[: req.kv_len]
        aligned = len(self._aligned(tokens))
        own_start = len(req.prefix_indices)
        already = self.insert(tokens[:aligned], kv[:aligned], req.extra_key)
        if already > own_start:
            # Another request cached these tokens first: keep the tree's copy, free ours.
            self.allocator.free(kv[own_start:already])
        return kv, aligned

    def cache_finished_req(self, req: Req) -> None:
        kv, aligned = self._insert_req(req)
        self.allocator.free(kv[aligned:])  # the unaligned tail page is ours alone
        self.dec_lock_ref(req.last_node)
        self.req_to_token.free(req.req_pool_idx)
        req.reset_kv_state()

    def cache_unfinished_req(self, req: Req) -> None:
        own_start = len(req.prefix_indices)
        kv, aligned = self._insert_req(req)
        # NOTE: the tree owns kv[:aligned] from here on (its duplicates are freed already):
        # should what follows raise, release_req must free only what lies past them
        req.prefix_indices = kv[:aligned]
        match = self.match_prefix(req.all_token_ids()[:aligned], req.extra_key)
        # Point the request's row at the tree's slots (they differ where we freed duplicates).
        self.req_to_token.write(req.req_pool_idx, own_start, match.kv_indices[own_start:])
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node = match.kv_indices, match.last_node
        req.last_loc = None  # the row now points at the tree's slots
