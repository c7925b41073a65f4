"""Kernel tests run two ways: compiled on a CUDA GPU (marked ``gpu``) and through Triton's
CPU interpreter with small shapes (marked ``interpret``, run when ``TRITON_INTERPRET=1``
was set before ``kvflow.kernels`` was imported; ``test_interpreter_suite.py`` starts such
a process when this one compiles). Each test checks a kernel against its torch reference.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import INTERPRETED


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "interpret: runs a Triton kernel on CPU tensors under TRITON_INTERPRET=1"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") and (INTERPRETED or not torch.cuda.is_available()):
        pytest.skip("needs a CUDA GPU and compiled (not interpreted) Triton kernels")
    if item.get_closest_marker("interpret") and not INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1 before import (test_interpreter_suite.py runs it)")
