"""``kvflow.operator`` (and the ``kvflow operator`` entry point) import without torch."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import kvflow.operator
import kvflow.operator.main
import kvflow.operator.handlers
from kvflow.cli import COMMANDS
import importlib
module, func, _ = COMMANDS["operator"]
getattr(importlib.import_module(module), func)
heavy = sorted(m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in ("torch", "transformers", "triton", "numpy"))
assert not heavy, heavy
print("ok")
"""


def test_operator_imports_with_torch_blocked() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_blocking_torch_is_effective() -> None:
    # The probe's blocking must really make `import torch` fail, or the test above proves nothing.
    probe = 'import sys; sys.modules["torch"] = None\ntry:\n import torch\nexcept ImportError:\n print("blocked")'
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "blocked", done.stderr
