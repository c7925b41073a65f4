"""Builds and loads kvflow's native CPU kernels: C sources beside this file, compiled once per
machine with the system C compiler into a shared library, loaded with :mod:`ctypes`.

The library is built with ``-O3 -march=native -pthread`` and the parts of ``-ffast-math``
the kernels need (reassociation, reciprocals, no errno, finite math), named one by one:
given as ``-ffast-math``, gcc links ``crtfastmath.o``, whose constructor turns on
flush-to-zero and denormals-are-zero for the whole process that loads the library (torch's
ops and every other library's included; tests/kernels/test_cpu_fp_state.py). Cached under
``$KVFLOW_CACHE_DIR/cpu-kernels/<key>/`` (default ``~/.cache/kvflow``), the key hashing the
sources, flags, compiler and CPU, so a source change or another machine rebuilds it. Builds
are atomic (compile to a temporary name, then rename), so concurrent processes are safe.
The kernels run their parallel loops on their own thread pool (``pool.c``), not OpenMP: see
:mod:`kvflow.kernels.cpu.pool` for why and for its thread count.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["NativeBuildError", "cache_dir", "function", "load_library"]

SOURCES = (
    "paged_attention.c",
    "elementwise.c",
    "gemm.c",
    "qgemm.c",
    "pool.c",
    "decoder_stack.c",
)
HEADERS = ("bf16.h", "pool.h")
# -ffast-math's parts, without the option that links crtfastmath.o (see the docstring).
FAST_MATH = (
    "-fno-math-errno",
    "-ffinite-math-only",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fassociative-math",
    "-freciprocal-math",
    "-fcx-limited-range",
)
FLAGS = ("-O3", "-march=native", *FAST_MATH, "-pthread", "-shared", "-fPIC")
LIBS = ("-lm",)
_HERE = Path(__file__).resolve().parent


class NativeBuildError(RuntimeError):
    """No C compiler, or the sources did not compile on this machine."""


def cache_dir() -> Path:
    root = os.environ.get("KVFLOW_CACHE_DIR") or Path.home() / ".cache" / "kvflow"
    return Path(root) / "cpu-kernels"


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeBuildError("no C compiler found (set CC, or install gcc)")
    return compiler


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build_key(compiler: str) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    digest = hashlib.sha256()
    for part in (*FLAGS, *LIBS, version, _cpu_signature()):
        digest.update(part.encode())
    for name in (*SOURCES, *HEADERS):
        digest.update((_HERE / name).read_bytes())
    return digest.hexdigest()[:16]


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    argv = [compiler, *FLAGS, "-o", tmp, *(str(_HERE / s) for s in SOURCES), *LIBS]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"{' '.join(argv)} failed:\n{done.stderr.strip()}")
    os.replace(tmp, target)


@functools.cache
def load_library() -> ctypes.CDLL:
    """The compiled kernels (built on first use); raises :class:`NativeBuildError`."""
    compiler = _compiler()
    target = cache_dir() / _build_key(compiler) / "libkvflow_cpu.so"
    if not target.exists():
        try:
            _build(compiler, target)
        except OSError as exc:  # a read-only cache folder, say
            raise NativeBuildError(f"cannot build into {target.parent}: {exc}") from exc
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeBuildError(f"cannot load {target}: {exc}") from exc


def function(name: str, argtypes: list[Any], restype: Any = None) -> Any:
    """The library's C function ``name``, typed with ``argtypes`` and ``restype`` (None: void)."""
    fn = getattr(load_library(), name)
    if fn.argtypes is None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn
