"""Package surfaces that load their heavy names on first use (``kvflow.lazy``) give every
name of their ``__all__``, as the objects of the modules that define them (a function, not
the submodule of the same name: ``kvflow.kernels.gemv``)."""

from __future__ import annotations

import subprocess
import sys

PACKAGES = (
    "kvflow.kernels",
    "kvflow.kernels.cpu",
    "kvflow.runtime.attention",
    "kvflow.runtime.cache",
    "kvflow.runtime.cache.storage",
    "kvflow.runtime.distributed",
    "kvflow.runtime.grammar",
    "kvflow.runtime.layers",
    "kvflow.runtime.layers.quantization",
    "kvflow.runtime.lora",
    "kvflow.runtime.scheduler",
)
SUBMODULES = {"kvflow.kernels.cpu": ("decoder_stack", "elementwise", "gemm", "pool", "qgemm")}

PROBE = """
import importlib, sys, types
package, submodules = sys.argv[1], sys.argv[2:]
pkg = importlib.import_module(package)
for name in pkg.__all__:
    value = getattr(pkg, name)
    assert isinstance(value, types.ModuleType) == (name in submodules), (package, name, value)
    assert getattr(pkg, name) is value
print("ok")
"""


def test_every_name_of_a_lazy_package_resolves() -> None:
    for package in PACKAGES:  # each in a fresh process: no other import may help
        done = subprocess.run(
            [sys.executable, "-P", "-c", PROBE, package, *SUBMODULES.get(package, ())],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (package, done.stderr)


def test_a_sibling_name_leaves_the_function_not_its_module() -> None:
    # loading kernels/gemv.py for gemv_ref sets kvflow.kernels.gemv to the submodule;
    # the package must still give the function of that name
    code = (
        "from kvflow.kernels import fused_moe_ref, gemv_ref\n"
        "import kvflow.kernels as kernels, types\n"
        "assert not isinstance(kernels.gemv, types.ModuleType)\n"
        "assert not isinstance(kernels.fused_moe, types.ModuleType)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
