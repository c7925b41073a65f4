"""Two-level KV memory: request slots -> token positions -> KV slots in per-layer tensors."""

from kvflow.runtime.mem.allocator import TokenToKVPoolAllocator
from kvflow.runtime.mem.kv_pool import KVPool
from kvflow.runtime.mem.req_to_token import ReqToTokenPool

__all__ = ["KVPool", "ReqToTokenPool", "TokenToKVPoolAllocator"]
