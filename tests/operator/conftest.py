"""Fixtures of the operator's unit tests: every spec with a golden file, by name."""

from __future__ import annotations

import pytest
from operator_testing import SPECS


@pytest.fixture(params=sorted(SPECS))
def spec_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)
