"""The suite's skip policy, for ``tests/`` and ``e2e/`` alike.

In CI (``$CI`` set to ``true`` or ``1``) a test may skip only for hardware this machine
lacks (a GPU, CUDA, an RDMA device, native bfloat16) or because another test re-runs it in
the right mode (the Triton interpreter suite). Any other skip (a tool the setup should have provided:
sglang-router, SGLang's client, helm, Prometheus, mooncake_master, containerd, ...) is
reported as a failure with the skip's reason, so a broken setup cannot pass quietly.
"""

from __future__ import annotations

import os
import re

import pytest

# Skip reasons that stand for missing hardware, or a test run elsewhere in the suite.
HARDWARE_SKIPS = re.compile(
    r"cuda|gpu|rdma|native bfloat16|interpret tests already run|TRITON_INTERPRET", re.IGNORECASE
)


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if not (_in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report)
    if HARDWARE_SKIPS.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = f"skipped in CI, where the setup must provide what it needs: {reason}"
