"""Native CPU kernels (C on their own thread pool, built on first use; see :mod:`.build`),
each beside a pure-torch reference of its contract. The torch attention backend is the portable path;
these make the CPU serving path fast where a C compiler is at hand."""

import functools
import logging
import os
from typing import TYPE_CHECKING

from kvflow.kernels.cpu import pool
from kvflow.kernels.cpu.build import NativeBuildError, load_library
from kvflow.kernels.cpu.features import native_bf16
from kvflow.lazy import lazy_exports

if TYPE_CHECKING:
    from kvflow.kernels.cpu import decoder_stack, elementwise, gemm, qgemm
    from kvflow.kernels.cpu.paged_attention import (
        MAX_GROUP,
        MAX_HEAD_DIM,
        paged_attention,
        paged_attention_ref,
        supports,
    )
else:  # torch-free until a name is used: available() is asked where torch is not loaded
    __getattr__ = lazy_exports(
        __name__,
        {
            ".paged_attention": (
                "MAX_GROUP",
                "MAX_HEAD_DIM",
                "paged_attention",
                "paged_attention_ref",
                "supports",
            )
        },
        submodules=("decoder_stack", "elementwise", "gemm", "qgemm"),
    )

log = logging.getLogger(__name__)

__all__ = [
    "MAX_GROUP",
    "MAX_HEAD_DIM",
    "NativeBuildError",
    "available",
    "decoder_stack",
    "elementwise",
    "gemm",
    "load_library",
    "native_bf16",
    "paged_attention",
    "paged_attention_ref",
    "pool",
    "qgemm",
    "supports",
]


@functools.cache
def available() -> bool:
    """Whether the native kernels are on: not switched off with ``KVFLOW_CPU_KERNELS=0``,
    and they build and load here (tried once per process; a failure is logged)."""
    if os.environ.get("KVFLOW_CPU_KERNELS", "1") == "0":
        return False
    try:
        load_library()
    except NativeBuildError as exc:
        log.warning("native CPU kernels unavailable, running the torch paths: %s", exc)
        return False
    return True
