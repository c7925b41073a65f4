"""Which prefix cache an engine runs, chosen by name from its configuration."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvflow.runtime.cache.base import PrefixCache
from kvflow.runtime.utils.registry import Registry

if TYPE_CHECKING:
    from kvflow.runtime.cache.storage import PageStore
    from kvflow.runtime.cache.storage_tier import StorageTier
    from kvflow.runtime.config import EngineConfig
    from kvflow.runtime.distributed import Lockstep
    from kvflow.runtime.mem.host_pool import HostKVPool
    from kvflow.runtime.model_runner import ModelRunner

__all__ = ["PREFIX_CACHES", "make_prefix_cache", "prefix_cache_kind"]
logger = logging.getLogger(__name__)
STORE_CONNECT_WAIT_S = 15.0  # at start-up, for a store that connects in the background

# name -> factory(config, runner, lockstep) -> PrefixCache
PREFIX_CACHES: Registry[PrefixCache] = Registry("prefix cache")
PREFIX_CACHES.register("none", "kvflow.runtime.cache.factory:_no_prefix")
PREFIX_CACHES.register("radix", "kvflow.runtime.cache.factory:_radix")
PREFIX_CACHES.register("hiradix", "kvflow.runtime.cache.factory:_hiradix")


def prefix_cache_kind(config: EngineConfig) -> str:
    """``none`` with the radix cache disabled, ``hiradix`` with a host tier, else ``radix``."""
    if config.disable_radix_cache:
        return "none"
    return "hiradix" if config.hicache_host_memory_gb > 0 else "radix"


def make_prefix_cache(config: EngineConfig, runner: ModelRunner, lockstep: Lockstep) -> PrefixCache:
    """The configured cache; ``lockstep`` is how its asynchronous events (HiCache's storage
    transfers) are agreed across tensor-parallel ranks."""
    return PREFIX_CACHES.get(prefix_cache_kind(config))(config, runner, lockstep)


def _no_prefix(config: EngineConfig, runner: ModelRunner, lockstep: Lockstep) -> PrefixCache:
    from kvflow.runtime.cache.no_prefix import NoPrefixCache

    return NoPrefixCache(runner.req_to_token, runner.allocator)


def _radix(config: EngineConfig, runner: ModelRunner, lockstep: Lockstep) -> PrefixCache:
    from kvflow.runtime.cache.radix import RadixCache

    return RadixCache(runner.req_to_token, runner.allocator)


def _hiradix(config: EngineConfig, runner: ModelRunner, lockstep: Lockstep) -> PrefixCache:
    from kvflow.runtime.cache.hiradix import HiRadixCache
    from kvflow.runtime.mem.host_pool import HostKVPool

    host = HostKVPool.sized(runner.kv_pool, runner.page_size, config.hicache_host_memory_gb)
    storage = (
        _storage_tier(config, runner, host, lockstep) if config.hicache_storage != "none" else None
    )
    return HiRadixCache(
        runner.req_to_token,
        runner.allocator,
        runner.kv_pool,
        host,
        config.hicache_write_policy,
        storage,
    )


def _storage_tier(
    config: EngineConfig, runner: ModelRunner, host: HostKVPool, lockstep: Lockstep
) -> StorageTier:
    """The L3 link: a store of the configured backend behind a background I/O worker, in
    a namespace of this model's identity (same model, KV dtype, page layout -> same keys) and
    of this rank's share of the KV heads (each tensor-parallel rank stores its own)."""
    from kvflow.runtime.cache.storage import StorageConfig, StorageIO, StoreNamespace, create_store
    from kvflow.runtime.cache.storage_tier import StorageTier

    mc = runner.model_config
    namespace = StoreNamespace(
        model=_model_identity(config, runner),
        # the KV as stored (--kv-cache-dtype): an FP8 page is never read back as bfloat16
        dtype=str(runner.kv_dtype).removeprefix("torch."),
        page_size=runner.page_size,
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        layout="page_first",
        tp_size=runner.tp.size if runner.tp else 1,
        tp_rank=runner.tp.rank if runner.tp else 0,
        kv_bytes_per_token=host.page_bytes // runner.page_size,
    )
    store = create_store(
        StorageConfig.from_flags(config.hicache_storage, config.hicache_storage_path)
    )
    store.register(host.data)  # page buffers are views into it
    _wait_connected(store, STORE_CONNECT_WAIT_S)
    return StorageTier(
        config.hicache_storage,
        StorageIO(store),
        namespace,
        host,
        config.hicache_prefetch_timeout,
        lockstep,
    )


def _wait_connected(store: PageStore, budget_s: float) -> None:
    """Give a store that connects in the background (Mooncake) a bounded moment before the
    server reports ready, so its first requests can use it; past that, serve on L1/L2 and
    let it connect later."""
    deadline = time.monotonic() + budget_s
    while not store.stats().available:
        if time.monotonic() > deadline:
            logger.warning(
                "HiCache storage not reachable after %.0f s: serving on the device and host "
                "tiers until it connects",
                budget_s,
            )
            return
        time.sleep(0.05)


def _model_identity(config: EngineConfig, runner: ModelRunner) -> str:
    """The folder's name and a digest of what determines the weights: the model's
    ``config.json`` (and for dummy weights, the seed they are drawn with)."""
    folder = Path(runner.model_path)
    digest = hashlib.blake2b(digest_size=8)
    config_file = folder / "config.json" if folder.is_dir() else folder
    if config_file.is_file():
        digest.update(config_file.read_bytes())
    if config.load_format == "dummy":
        digest.update(f"dummy:{config.seed}".encode())
    return f"{folder.name}:{digest.hexdigest()}"
