"""Incremental detokenization that is exact across multi-byte characters, and stop trimming."""

from kvflow.runtime.detokenizer.incremental import IncrementalDetokenizer
from kvflow.runtime.detokenizer.stream import TextStream, find_stop

__all__ = ["IncrementalDetokenizer", "TextStream", "find_stop"]
