"""Prefix caches over the KV pool: a radix tree, or none (``disable_radix_cache``)."""

from typing import TYPE_CHECKING

from kvflow.lazy import lazy_exports

if TYPE_CHECKING:
    from kvflow.runtime.cache.base import MatchResult, PrefixCache
    from kvflow.runtime.cache.no_prefix import NoPrefixCache
    from kvflow.runtime.cache.radix import RadixCache, TreeNode
else:  # torch-free until a name is used (kvflow.lazy)
    __getattr__ = lazy_exports(
        __name__,
        {
            ".base": ("MatchResult", "PrefixCache"),
            ".no_prefix": ("NoPrefixCache",),
            ".radix": ("RadixCache", "TreeNode"),
        },
    )

__all__ = ["MatchResult", "NoPrefixCache", "PrefixCache", "RadixCache", "TreeNode"]
