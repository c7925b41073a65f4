"""HiRadixCache: the radix cache over two tiers, device KV (L1) and host KV (L2).

Each node's KV lives on the device (``value``), on the host (``host_value``) or both::

    root --[a]--> A (device+host) --[b]--> B (device) --[c]--> C (host only)

Invariants:

- Device residency is closed under ancestors: a node on the device has every ancestor on
  the device. So a match is a device run followed by a host-only run, and device
  eviction takes only "device leaves" (no child on the device), least recently used
  first. A host-only node has only host-only children.
- Every node holds its KV somewhere; a node losing its last copy leaves the tree (with its
  host-only subtree).
- ``write_through`` backs a node up to host when its KV enters the tree; ``write_back``
  when the device evicts it. Either way a device eviction keeps the host copy, and a host
  hit is loaded back (:meth:`load_back`) before the request's prefill.
- Host eviction (LRU) drops host-only leaves, or the host copy of a node still on the
  device; nodes pinned by a load-back or an unfinished storage write are kept.

Sizes reported to the scheduler (``evictable_size``, ``total_size``) count device tokens,
as for :class:`~kvflow.runtime.cache.radix.RadixCache`.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvflow.runtime.cache.base import MatchResult
from kvflow.runtime.cache.radix import RadixCache, TreeNode
from kvflow.runtime.cache.storage_tier import MIN_PREFETCH_TOKENS, StorageTier
from kvflow.runtime.cache.tier_copy import Copy, TierCopy
from kvflow.runtime.wire.hicache import HICACHE_WRITE_POLICIES, HiCacheStats

if TYPE_CHECKING:
    from kvflow.runtime.mem import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
    from kvflow.runtime.mem.host_pool import HostKVPool

__all__ = ["WRITE_POLICIES", "HiRadixCache", "HiTreeNode", "TierCounters"]

WRITE_POLICIES = HICACHE_WRITE_POLICIES


class HiTreeNode(TreeNode):
    """A radix node with a host copy: ``value`` is None once the device evicted it."""

    __slots__ = ("backup", "host_value", "page_keys", "pins")

    def __init__(self, key: list[int], value: Any, parent: TreeNode | None) -> None:
        super().__init__(key, value, parent)
        self.host_value: torch.Tensor | None = None
        self.backup: Copy | None = None  # the device-to-host copy, until it has landed
        self.pins = 0  # host copy in use (load-back, storage write): not host-evictable
        self.page_keys: list[str] | None = None  # L3 keys of its pages, once computed

    @property
    def on_device(self) -> bool:
        return self.value is not None


@dataclass
class TierCounters:
    """Cumulative counts of a tiered cache (published as metrics)."""

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0  # loaded back from host for a request
    backed_up_tokens: int = 0  # device -> host copies
    host_evicted_tokens: int = 0
    dropped_tokens: int = 0  # device evictions that found no room on host


class HiRadixCache(RadixCache):
    """A :class:`RadixCache` whose device evictions spill to a host pool."""

    def __init__(
        self,
        req_to_token: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        device_pool: KVPool,
        host_pool: HostKVPool,
        write_policy: str = "write_through",
        storage: StorageTier | None = None,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}; choose from {WRITE_POLICIES}")
        if host_pool.page_size != allocator.page_size:
            raise ValueError("the host pool's page size must equal the device pool's")
        self.host = host_pool
        self.copier = TierCopy(device_pool, host_pool)
        self.write_policy = write_policy
        self.counters = TierCounters()
        self.storage = storage
        self._to_store: list[HiTreeNode] = []  # backed up; written to L3 once the copy lands
        super().__init__(req_to_token, allocator)

    def _new_node(self, key: list[int], value: Any, parent: TreeNode | None) -> TreeNode:
        return HiTreeNode(key, value, parent)

    def reset(self) -> None:
        """Drop every entry, host copies included (``/flush_cache``)."""
        if hasattr(self, "_roots"):
            self.copier.wait_all()
            if self.storage is not None:  # writes in flight still read host pages
                self._to_store = []  # not written yet: dropped with the tree
                self.storage.io.drain(30.0)
                self.poll()
            for node in self._nodes():
                if node.host_value is not None:
                    self.host.allocator.free(node.host_value)
        super().reset()

    # -- sizes -----------------------------------------------------------------------------
    def host_used_size(self) -> int:
        return self.host.allocator.size - self.host.allocator.available_size()

    def _nodes(self) -> list[HiTreeNode]:
        found, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                found.append(node)
            stack.extend(node.children.values())
        return found  # type: ignore[return-value]

    # -- matching --------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], extra_key: str | None = None) -> MatchResult:
        path: list[HiTreeNode] = self._match_path(token_ids, extra_key)  # type: ignore[assignment]
        device = [node for node in path if node.on_device]
        host_len = sum(len(node.key) for node in path if not node.on_device)
        values = [node.value for node in device]
        kv = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        device_end = device[-1] if device else self._root(extra_key)
        return MatchResult(kv, device_end, host_len, path[-1] if host_len else None)

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        assert isinstance(child, HiTreeNode)
        if child.backup is not None:
            child.backup.wait()
            child.backup = None
        value = child.value
        if value is None:  # host only: the base split slices value, so give it the host one
            child.value = child.host_value
        head: HiTreeNode = super()._split(child, at)  # type: ignore[assignment]
        if value is None:
            child.value = head.value = None
        if child.host_value is not None:
            head.host_value, child.host_value = child.host_value[:at], child.host_value[at:]
        head.pins = child.pins
        if child.page_keys is not None:
            cut = at // self.page_size
            head.page_keys, child.page_keys = child.page_keys[:cut], child.page_keys[cut:]
        if any(n is child for n in self._to_store):  # both halves still go to storage
            self._to_store.append(head)
        return head

    def load_back(self, match: MatchResult) -> MatchResult:
        """Copy the host-only part of ``match`` to the device and make it device-resident.

        Takes device pages (evicting other unlocked entries if needed); when even that is
        not enough, the match stays as it was and the request computes those tokens.
        """
        if not match.host_hit_len:
            return match
        path: list[HiTreeNode] = []
        node = match.host_last_node
        while node is not match.last_node:
            path.append(node)
            node = node.parent
        path.reverse()
        for n in path:
            n.pins += 1
        try:
            slots = self._take_device(match.host_hit_len, protect=match.last_node)
        finally:
            for n in path:
                n.pins -= 1
        if slots is None:
            return match
        offset = 0
        for n in path:
            if n.backup is not None:
                n.backup.wait()
                n.backup = None
            assert n.host_value is not None
            n.value = slots[offset : offset + len(n.key)]
            offset += len(n.key)
            self.copier.to_device(n.host_value, n.value)
            if n.lock_ref == 0:
                self._evictable += len(n.key)
            else:  # cannot happen (host-only nodes are never locked); keep counts exact
                self._protected += len(n.key)
        self.counters.host_hit_tokens += match.host_hit_len
        kv = torch.cat([match.kv_indices, slots]) if len(match.kv_indices) else slots
        return MatchResult(kv, match.host_last_node)

    def _take_device(self, num_tokens: int, protect: Any) -> torch.Tensor | None:
        slots = self.allocator.alloc_for_request(0, 0, num_tokens)
        if slots is None:
            self.inc_lock_ref(protect)  # the matched device prefix must stay
            try:
                self.evict(num_tokens - self.allocator.available_size())
            finally:
                self.dec_lock_ref(protect)
            slots = self.allocator.alloc_for_request(0, 0, num_tokens)
        # NOTE: on the pool's device, as every other device node's value (slices of
        # req_to_token): a match concatenates the values along its path
        device = self.allocator.device
        return None if slots is None else torch.tensor(slots, dtype=torch.int64, device=device)

    # -- inserting -------------------------------------------------------------------------
    def insert(
        self, token_ids: list[int], kv_indices: torch.Tensor, extra_key: str | None = None
    ) -> int:
        """As :meth:`RadixCache.insert`; a host-only node on the path adopts the caller's
        KV for its tokens (they are not counted as already cached: the caller keeps them
        in the tree rather than freeing them)."""
        key = self._aligned(token_ids)
        value = kv_indices[: len(key)]
        node: HiTreeNode = self._root(extra_key)  # type: ignore[assignment]
        already, adopting = 0, False
        new_nodes: list[HiTreeNode] = []
        while key:
            child: HiTreeNode | None = node.children.get(self._edge(key))  # type: ignore[assignment]
            if child is None:
                leaf: HiTreeNode = self._new_node(list(key), value.clone(), node)  # type: ignore[assignment]
                self._touch(leaf)
                node.children[self._edge(key)] = leaf
                self._evictable += len(key)
                new_nodes.append(leaf)
                break
            self._touch(child)
            n = self._common_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)  # type: ignore[assignment]
            if child.on_device:
                assert not adopting, "a device node below a host-only one"
                already += n
            else:
                adopting = True
                child.value = value[:n].clone()
                self._evictable += n  # host-only nodes are never locked
            node, key, value = child, key[n:], value[n:]
        if self.write_policy == "write_through":
            for leaf in new_nodes:
                self._backup(leaf)
        return already

    # -- device eviction -------------------------------------------------------------------
    def _is_device_leaf(self, node: HiTreeNode) -> bool:
        return (
            node.on_device
            and node.lock_ref == 0
            and node.parent is not None
            and not any(c.value is not None for c in node.children.values())
        )

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens: each evicted node keeps (or gets)
        a host copy, or leaves the tree with its host-only subtree when the host is full."""
        heap = [n for n in self._nodes() if self._is_device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            node = heapq.heappop(heap)
            if not self._is_device_leaf(node):
                continue
            parent = node.parent
            assert node.value is not None and parent is not None
            size = len(node.key)
            if node.host_value is None and not self._backup(node):
                if self._subtree_pinned(node):
                    continue  # a storage write still reads its subtree's host pages
                self._remove_subtree(node)
                self.counters.dropped_tokens += size
            else:
                if node.backup is not None:
                    node.backup.wait()
                    node.backup = None
                self.allocator.free(node.value)
                node.value = None
            freed += size
            self._evictable -= size
            if isinstance(parent, HiTreeNode) and self._is_device_leaf(parent):
                heapq.heappush(heap, parent)
        return freed

    @staticmethod
    def _subtree_pinned(node: HiTreeNode) -> bool:
        stack = [node]
        while stack:
            n = stack.pop()
            if n.pins:
                return True
            stack.extend(n.children.values())  # type: ignore[arg-type]
        return False

    def _remove_subtree(self, node: HiTreeNode) -> None:
        """Take ``node`` out of the tree: free its device KV and its subtree's host KV."""
        assert node.parent is not None
        del node.parent.children[self._edge(node.key)]
        if node.value is not None:
            self.allocator.free(node.value)
        stack = [node]
        while stack:
            n = stack.pop()
            self._drop_host(n)
            stack.extend(n.children.values())  # type: ignore[arg-type]

    # -- host tier -------------------------------------------------------------------------
    def _backup(self, node: HiTreeNode) -> bool:
        """Give ``node`` a host copy (evicting host entries if needed); False if no room."""
        size = len(node.key)
        host_slots = self._take_host(size)
        if host_slots is None:
            return False
        node.host_value = host_slots
        assert node.value is not None
        copy = self.copier.to_host(node.value, node.host_value)
        node.backup = None if copy.finished else copy
        self.counters.backed_up_tokens += size
        if self.storage is not None:
            self._to_store.append(node)
        return True

    def _drop_host(self, node: HiTreeNode) -> None:
        if node.host_value is not None:
            if node.backup is not None:
                node.backup.wait()
                node.backup = None
            self.host.allocator.free(node.host_value)
            self.counters.host_evicted_tokens += len(node.key)
            node.host_value = None

    def _is_host_evictable(self, node: HiTreeNode) -> bool:
        if node.host_value is None or node.pins > 0:
            return False
        return node.on_device or not node.children

    def _evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens, least recently used first."""
        heap = [n for n in self._nodes() if self._is_host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            node = heapq.heappop(heap)
            if not self._is_host_evictable(node):
                continue
            freed += len(node.key)
            parent = node.parent
            if node.on_device:
                self._drop_host(node)
                continue
            assert parent is not None
            del parent.children[self._edge(node.key)]
            self._drop_host(node)
            if isinstance(parent, HiTreeNode) and self._is_host_evictable(parent):
                heapq.heappush(heap, parent)
        return freed

    def tier_stats(self, hits: Any) -> HiCacheStats:
        """The tiers' counters for metrics; ``hits`` is the scheduler's
        :class:`~kvflow.runtime.scheduler.kv.TierHits`."""
        c = self.counters
        base = HiCacheStats(
            host_total_tokens=self.host.size,
            host_used_tokens=self.host_used_size(),
            device_hit_tokens=hits.device,
            host_hit_tokens=hits.host,
            storage_hit_tokens=hits.storage,
            backed_up_tokens=c.backed_up_tokens,
            dropped_tokens=c.dropped_tokens,
        )
        if self.storage is None:
            return base
        io, store = self.storage.io.stats(), self.storage.io.store_stats()
        outcomes = io.prefetch_outcomes
        return dataclasses.replace(
            base,
            storage=self.storage.backend,
            storage_read_bytes=io.read_bytes,
            storage_write_bytes=io.write_bytes,
            storage_read_seconds=io.read_latency.sum_s,
            storage_write_seconds=io.write_latency.sum_s,
            storage_reads=io.read_latency.count,
            storage_writes=io.write_latency.count,
            storage_errors=store.errors + store.corrupt_pages + io.worker_errors,
            prefetch_full=outcomes.get("hit_full", 0),
            prefetch_partial=outcomes.get("partial", 0),
            prefetch_miss=outcomes.get("miss", 0),
            prefetch_timeout=outcomes.get("timeout", 0),
        )

    # -- storage tier (L3) -----------------------------------------------------------------
    def _extra_key(self, root: TreeNode) -> str | None:
        return next(k for k, r in self._roots.items() if r is root)

    def _keys_of(self, node: HiTreeNode) -> list[str]:
        """The L3 keys of ``node``'s pages (chained from the root; cached on the node)."""
        assert self.storage is not None
        if node.page_keys is None:
            parent = node.parent
            assert parent is not None
            if parent.parent is None:
                node.page_keys = self.storage.keys(node.key, self._extra_key(parent), None)
            else:
                prior = self._keys_of(parent)  # type: ignore[arg-type]
                node.page_keys = self.storage.keys(node.key, None, prior[-1])
        return node.page_keys

    def start_prefetch(self, req: Any) -> bool:
        """Look for the request's uncached full pages in L3, into fresh host pages."""
        if self.storage is None:
            return False
        tokens = req.all_token_ids()[:-1]
        match = self.match_prefix(tokens, req.extra_key)
        covered = len(match.kv_indices) + match.host_hit_len
        end = len(tokens) - len(tokens) % self.page_size
        if end - covered < max(self.page_size, MIN_PREFETCH_TOKENS):
            return False
        last = self._match_end(match)
        if last.parent is None:
            keys = self.storage.keys(tokens[covered:end], req.extra_key, None)
        else:
            keys = self.storage.keys(tokens[covered:end], None, self._keys_of(last)[-1])
        host_slots = self._take_host(end - covered)
        if host_slots is None:
            return False
        self.copier.wait_loads()  # a load-back's DMA may still read these host pages
        self.storage.start(req, tokens[:end], covered, keys, host_slots)
        return True

    @staticmethod
    def _match_end(match: MatchResult) -> Any:
        """The node ending a match's device and host runs together."""
        return match.host_last_node if match.host_hit_len else match.last_node

    def _take_host(self, num_tokens: int) -> torch.Tensor | None:
        """Host slots for ``num_tokens`` (whole pages), evicting host entries if needed."""
        slots = self.host.allocator.alloc_for_request(0, 0, num_tokens)
        if slots is None:
            self._evict_host(num_tokens - self.host.allocator.available_size())
            slots = self.host.allocator.alloc_for_request(0, 0, num_tokens)
        return None if slots is None else torch.tensor(slots, dtype=torch.int64)

    def _insert_host(
        self, tokens: list[int], start: int, slots: torch.Tensor, extra_key: Any
    ) -> int:
        """Add KV that arrived in host ``slots`` for ``tokens[start:]`` as a host-only
        leaf after whatever the tree already holds; frees the slots it does not use.
        Returns the tokens added (0 when the tree no longer reaches ``start``)."""
        match = self.match_prefix(tokens, extra_key)
        covered = len(match.kv_indices) + match.host_hit_len
        if covered < start or covered >= len(tokens):
            self.host.allocator.free(slots)
            return 0
        used = covered - start
        if used:
            self.host.allocator.free(slots[:used])
        parent = self._match_end(match)
        leaf: HiTreeNode = self._new_node(tokens[covered:], None, parent)  # type: ignore[assignment]
        leaf.host_value = slots[used:].clone()
        self._touch(leaf)
        parent.children[self._edge(leaf.key)] = leaf
        return len(leaf.key)

    def poll(self) -> list[Any]:
        self.copier.poll()
        if self.storage is None:
            return []
        pending = []
        # a write pins its node, so every rank starts it in the same round
        landed = self.storage.lockstep.all_true(
            [node.backup is None or node.backup.done() for node in self._to_store]
        )
        for node, done in zip(self._to_store, landed, strict=True):
            if not done:
                pending.append(node)
                continue
            node.backup = None
            if node.host_value is not None:  # still in the tree with its host copy
                self.storage.write(node, self._keys_of(node))
        self._to_store = pending
        done, late, _ = self.storage.poll()
        ready = list(late)
        for job, pages in done:
            usable = pages * self.page_size
            self.host.allocator.free(job.host_slots[usable:])  # pages that did not arrive
            added = 0
            if usable:
                end = job.start + usable
                added = self._insert_host(
                    job.tokens[:end], job.start, job.host_slots[:usable], job.req.extra_key
                )
            if not job.released:
                job.req.storage_hit_tokens = added
                ready.append(job.req)
        return ready
