"""Runtime fixtures: one engine on the embedded model per test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine(model_path):
    """A float32 engine shared by a module's tests (see ``make_engine``); it must end with
    all KV memory free."""
    from kvflow.runtime.engine import Engine

    engine = Engine(str(model_path), dtype="float32")
    yield engine
    assert engine.is_memory_free()
