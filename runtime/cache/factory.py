"""Which prefix cache an engine runs, chosen by name from its configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.runtime.cache.base import PrefixCache
from kvflow.runtime.utils.registry import Registry

if TYPE_CHECKING:
    from kvflow.runtime.config import EngineConfig
    from kvflow.runtime.model_runner import ModelRunner

__all__ = ["PREFIX_CACHES", "make_prefix_cache", "prefix_cache_kind"]

# name -> factory(config, runner) -> PrefixCache
PREFIX_CACHES: Registry[PrefixCache] = Registry("prefix cache")
PREFIX_CACHES.register("none", "kvflow.runtime.cache.factory:_no_prefix")
PREFIX_CACHES.register("radix", "kvflow.runtime.cache.factory:_radix")
PREFIX_CACHES.register("hiradix", "kvflow.runtime.cache.factory:_hiradix")


def prefix_cache_kind(config: EngineConfig) -> str:
    """``none`` with the radix cache disabled, ``hiradix`` with a host tier, else ``radix``."""
    if config.disable_radix_cache:
        return "none"
    return "hiradix" if config.hicache_host_memory_gb > 0 else "radix"


def make_prefix_cache(config: EngineConfig, runner: ModelRunner) -> PrefixCache:
    return PREFIX_CACHES.get(prefix_cache_kind(config))(config, runner)


def _no_prefix(config: EngineConfig, runner: ModelRunner) -> PrefixCache:
    from kvflow.runtime.cache.no_prefix import NoPrefixCache

    return NoPrefixCache(runner.req_to_token, runner.allocator)


def _radix(config: EngineConfig, runner: ModelRunner) -> PrefixCache:
    from kvflow.runtime.cache.radix import RadixCache

    return RadixCache(runner.req_to_token, runner.allocator)


def _hiradix(config: EngineConfig, runner: ModelRunner) -> PrefixCache:
    from kvflow.runtime.cache.hiradix import HiRadixCache
    from kvflow.runtime.mem.host_pool import HostKVPool

    host = HostKVPool.sized(runner.kv_pool, runner.page_size, config.hicache_host_memory_gb)
    return HiRadixCache(
        runner.req_to_token, runner.allocator, runner.kv_pool, host, config.hicache_write_policy
    )
