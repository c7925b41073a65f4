"""``kvflow.runtime.router`` and ``kvflow router --help`` work with torch and friends absent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.runtime.router import METRIC_NAMES

pytestmark = pytest.mark.timeout(120)

# A meta-path finder that refuses the heavy packages, as if they were not installed.
BLOCKER = """
import importlib.abc, sys
HEAVY = ("torch", "numpy", "triton", "transformers")
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ImportError(f"{name} is blocked in this test")
        return None
sys.meta_path.insert(0, Blocker())
"""

PROBE = (
    BLOCKER
    + """
import kvflow.runtime.router
import kvflow.runtime.router.cli
import kvflow.runtime.router.app
from kvflow.runtime.router.policies import POLICIES
for name in POLICIES.choices():
    POLICIES.get(name)
from kvflow.cli import main
try:
    main(["router", "--help"])
except SystemExit as done:
    assert done.code == 0, done.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
assert not heavy, heavy
print("ok")
"""
)


def test_router_imports_and_helps_with_heavy_packages_blocked() -> None:
    done = subprocess.run(
        [sys.executable, "-P", "-c", PROBE], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr
    assert "--worker-urls" in done.stdout and done.stdout.strip().endswith("ok")


def test_the_blocker_really_blocks() -> None:
    probe = BLOCKER + "\ntry:\n    import numpy\nexcept ImportError:\n    print('blocked')"
    done = subprocess.run(
        [sys.executable, "-P", "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "blocked", done.stderr


def test_every_metric_is_documented() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "router.md").read_text()
    for name in METRIC_NAMES:
        assert f"`{name}`" in doc, name
