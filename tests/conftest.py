"""Shared fixtures: the embedded model, a Hugging Face reference, and engines with leak checks."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_path() -> Path:
    from kvflow.runtime.models import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):
    from kvflow.runtime.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def hf_model(model_path: Path):
    """The same weights through transformers' own modeling code (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


@pytest.fixture
def make_engine(model_path: Path) -> Iterator[Callable[..., object]]:
    """Build engines on the embedded model; every engine must end with all KV memory free.
    They run float32 unless a test names a dtype: the float32 reference (``hf_model``) is
    matched token for token only in float32 (``auto`` is bfloat16 on CPUs with native bf16;
    tests/runtime/test_cpu_dtype.py checks that default against it)."""
    from kvflow.runtime.engine import Engine

    engines: list[Engine] = []

    def build(**kwargs) -> Engine:
        engine = Engine(str(model_path), **{"dtype": "float32", **kwargs})
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        assert engine.is_memory_free(), "KV memory or request rows leaked"
