"""What this CPU does natively, read once from ``/proc/cpuinfo``.

torch 2.15 has no public check for bfloat16 arithmetic (``torch.backends.cpu.
get_cpu_capability()`` says ``AVX512`` with or without it, and mkldnn's bf16 check is true
on any AVX512 core, where bfloat16 is emulated), so the kernel's own flags decide.
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["BF16_FLAGS", "cpu_flags", "native_bf16"]

# AVX512-BF16 (vdpbf16ps, what kvflow's bfloat16 matmul runs on) or AMX's bf16 tiles
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (empty where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (``flags``: this CPU's if None)."""
    return bool(BF16_FLAGS & (cpu_flags() if flags is None else flags))
