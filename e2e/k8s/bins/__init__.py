"""Kubernetes binaries: found in an explicit dir or the cache, else downloaded or built."""

from .cache import BinCache
from .resolve import BINARIES, Binaries, BinaryResolutionError, resolve_binaries

__all__ = ["BINARIES", "BinCache", "Binaries", "BinaryResolutionError", "resolve_binaries"]
