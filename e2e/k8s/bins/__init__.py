"""Kubernetes binaries: found in an explicit dir or the cache, else downloaded or built."""

from .cache import BinCache
from .lws import LWS_BINARIES
from .resolve import BINARIES, NODE_BINARIES, Binaries, BinaryResolutionError, resolve_binaries

__all__ = [
    "BINARIES",
    "LWS_BINARIES",
    "NODE_BINARIES",
    "BinCache",
    "Binaries",
    "BinaryResolutionError",
    "resolve_binaries",
]
