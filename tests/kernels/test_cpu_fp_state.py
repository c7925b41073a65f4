"""Loading the native CPU kernels leaves the process's floating-point state alone: a library
linked with -ffast-math turns on flush-to-zero / denormals-are-zero for every op of the
process that loads it (seen: subnormals read as 0.0 in Python and torch alike)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvflow.kernels import cpu

PROBE = """
import sys
tiny, one = float(sys.argv[1]), float(sys.argv[2])
from kvflow.kernels.cpu import build
build.load_library()
import torch
x = torch.tensor([tiny], dtype=torch.float64)
print(tiny * one, float(x * one))
"""


@pytest.mark.skipif(not cpu.available(), reason="no C compiler for the native kernels")
def test_subnormals_survive_loading_the_kernels():
    # A fresh process: this one may have loaded the library already.
    out = subprocess.run(
        [sys.executable, "-P", "-c", PROBE, "5e-324", "1.0"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.split()
    assert [float(v) for v in out] == [5e-324, 5e-324]
