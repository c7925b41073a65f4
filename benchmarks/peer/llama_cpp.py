"""llama.cpp's ``llama-server``, built from the llama.cpp sources vendored in PyPI's
``llama-cpp-python`` sdist with Debian's cmake and g++, cached.

    ~/.cache/kvflow/llama.cpp-<version>/
        llama_cpp_python-<version>.tar.gz     pip download --no-binary :all: --no-deps
        llama_cpp_python-<version>/vendor/llama.cpp/   the sources
        build/bin/llama-server                cmake -G Ninja (or make), Release, native CPU
        build-noamx/bin/llama-server          the same without AMX instructions, where the CPU
                                              lists AMX but using a tile faults (see below)

Rebuilt only when that binary is missing. Missing build tools (cmake, g++, ninja) are
installed with apt-get (root, or sudo).

Some virtual machines list ``amx_tile``/``amx_int8`` in ``/proc/cpuinfo`` while the first
tile instruction raises SIGILL (the hypervisor does not enable the tile state). A native
build then compiles ggml's AMX matmul in and ``llama-server`` dies on its first batch;
:func:`amx_faults` runs a tile instruction in a child process first, and where it faults
the build turns AMX off (``-mno-amx-*``), as a user on such a machine has to.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = ["LLAMA_CPP_PYTHON_VERSION", "default_cache", "ensure_llama_server", "llama_server_argv"]

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # this machine's ISA (AVX512, AVX512-BF16 here), as a local build does
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)
_DEBIAN_TOOLS = {"cmake": "cmake", "g++": "g++", "ninja": "ninja-build"}


def default_cache(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    root = Path(os.environ.get("KVFLOW_CACHE_DIR", Path.home() / ".cache" / "kvflow"))
    return root / f"llama.cpp-{version}"


_AMX_PROBE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64] = {0};
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
    cfg[0] = 1;   /* palette 1 */
    cfg[16] = 64; /* tile 0: 64 bytes a row */
    cfg[48] = 1;  /* tile 0: 1 row */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def amx_faults() -> bool:
    """Whether this machine lists AMX in ``/proc/cpuinfo`` but its first tile instruction
    faults (False where AMX is not listed, or where the compiler cannot build the probe:
    the native build is then left as it was)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    if "amx_tile" not in flags:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        source, probe = Path(tmp) / "probe.c", Path(tmp) / "probe"
        source.write_text(_AMX_PROBE)
        built = subprocess.run(
            ["cc", "-O1", "-mamx-tile", str(source), "-o", str(probe)], capture_output=True
        )
        if built.returncode != 0:
            return False
        return subprocess.run([str(probe)], capture_output=True).returncode != 0


def _install_tools() -> None:
    missing = [pkg for tool, pkg in _DEBIAN_TOOLS.items() if shutil.which(tool) is None]
    if not missing:
        return
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    print(f"peer: installing Debian packages {missing}", flush=True)
    subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True)
    subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", *missing], check=True)


def ensure_llama_server(
    cache: Path | None = None, version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None
) -> Path:
    """The ``llama-server`` binary, built on first use (several minutes on 2 cores)."""
    cache = cache or default_cache(version)
    no_amx = amx_faults()
    build = cache / ("build-noamx" if no_amx else "build")
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    _install_tools()
    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        pip = [sys.executable, "-P", "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        subprocess.run([*pip, f"llama-cpp-python=={version}", "-d", str(cache)], check=True)
    source = cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not source.is_dir():
        with tarfile.open(sdist) as archive:
            archive.extractall(cache, filter="data")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    amx_off = (f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}") if no_amx else ()
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build), *generator, *CMAKE_FLAGS, *amx_off],
        check=True,
    )
    jobs = jobs or os.cpu_count() or 1
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)], check=True
    )
    return binary


def llama_server_argv(
    binary: Path, gguf: Path, port: int, threads: int, parallel: int, context: int
) -> list[str]:
    """``llama-server`` on ``gguf`` with continuous batching over ``parallel`` slots that
    share ``context`` tokens of KV cache; the GGUF's own chat template (``--jinja``)."""
    return [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-np",
        str(parallel),
        "-c",
        str(context),
        "--jinja",
        "--no-webui",
    ]
