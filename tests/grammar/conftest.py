"""Fixtures of the structured-output tests: the grammar backend of the embedded model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "server"))


@pytest.fixture(scope="module")
def backend(tokenizer):
    from kvflow.runtime.grammar import GrammarBackend

    eos = tokenizer.eos_token_id
    grammars = GrammarBackend(lambda: tokenizer, len(tokenizer), (eos,))
    yield grammars
    grammars.shutdown()
