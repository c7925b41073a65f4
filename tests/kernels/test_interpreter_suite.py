"""Runs the ``interpret``-marked kernel tests in a fresh process with TRITON_INTERPRET=1.

Triton picks interpreter or compiler when a kernel is decorated, i.e. when
``kvflow.kernels`` is first imported, so a CPU-only CI run (which compiles nothing) needs
its own process for them. Under ``TRITON_INTERPRET=1`` they run in-process instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_testing import INTERPRETED

HERE = Path(__file__).parent


@pytest.mark.skipif(INTERPRETED, reason="interpret tests already run in this process")
def test_kernels_under_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    command = [
        sys.executable,
        "-P",
        "-m",
        "pytest",
        "-q",
        "-m",
        "interpret",
        "-p",
        "no:cacheprovider",
    ]
    result = subprocess.run(
        [*command, str(HERE)], env=env, capture_output=True, text=True, timeout=600
    )
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    summary = result.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 40, report
    assert "skipped" not in summary and "failed" not in summary, report
