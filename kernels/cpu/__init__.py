"""Native CPU kernels (C with OpenMP, built on first use; see :mod:`.native`), each beside a
pure-torch reference of its contract. The torch attention backend is the portable path;
these make the CPU serving path fast where a C compiler is at hand."""

from kvflow.kernels.cpu.native import NativeBuildError, load_library
from kvflow.kernels.cpu.paged_attention import paged_attention, paged_attention_ref, supports

__all__ = [
    "NativeBuildError",
    "available",
    "load_library",
    "paged_attention",
    "paged_attention_ref",
    "supports",
]


def available() -> bool:
    """Whether the native kernels build and load here (the build runs once per process)."""
    try:
        load_library()
    except NativeBuildError:
        return False
    return True
