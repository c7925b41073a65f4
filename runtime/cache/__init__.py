"""Prefix caches over the KV pool: a radix tree, or none (``disable_radix_cache``)."""

from kvflow.runtime.cache.base import MatchResult, PrefixCache
from kvflow.runtime.cache.no_prefix import NoPrefixCache
from kvflow.runtime.cache.radix import RadixCache, TreeNode

__all__ = ["MatchResult", "NoPrefixCache", "PrefixCache", "RadixCache", "TreeNode"]
