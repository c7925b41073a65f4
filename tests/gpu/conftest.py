"""GPU tests share one process: an engine left to the garbage collector keeps its KV pool
(sized from free memory) and CUDA graphs, and the next test's engine would find no room."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def release_cuda_memory() -> Iterator[None]:
    yield
    gc.collect()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
