"""Fixtures of the L3 storage tests: a real ``mooncake_master`` on loopback (module-scoped)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from l3_helpers import MooncakeMaster, mooncake_installed


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory) -> Iterator[MooncakeMaster]:
    if not mooncake_installed():
        pytest.skip("mooncake-transfer-engine-non-cuda (the dev extra) is not installed")
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log")
    yield master
    master.stop()
