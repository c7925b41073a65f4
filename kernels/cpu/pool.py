"""The thread pool of kvflow's native CPU kernels (``pool.c``).

The kernels do not use OpenMP: an OpenMP parallel region ends at a barrier that waits for
every thread of the team, so when another busy process shares the cores each kernel waits
for a descheduled sibling's time slice (on 2 cores with one busy process, torch's two
OpenMP threads decoded at 1-2 tok/s against 22 with one thread). The pool hands out chunks
of a loop to whichever of its threads are running; the calling thread only waits for chunks
another thread has claimed, and waiting threads spin briefly, yielding the core, then sleep.

The pool has its own thread count, separate from torch's: :func:`set_num_threads` (the
engine passes ``EngineConfig.cpu_threads``); until set, every core this process may run on.
"""

from __future__ import annotations

import ctypes

from kvflow.kernels.cpu.build import function

__all__ = ["get_num_threads", "set_num_threads"]


def set_num_threads(threads: int, spin_us: int = -1) -> None:
    """Threads the kernels' loops run on, the caller included (``threads <= 0``: every
    usable core); ``spin_us >= 0`` also sets how long an idle thread spins before it sleeps
    (default 300 us: the Python between two kernels of a decode step, ~70 us a gap on a
    2-core Xeon, outlasts a shorter spin and each kernel then waited for a futex wake-up)."""
    function("kvflow_pool_configure", [ctypes.c_int, ctypes.c_int])(threads, spin_us)


def get_num_threads() -> int:
    """Threads the kernels' loops run on, the caller included."""
    return int(function("kvflow_pool_threads", [], ctypes.c_int)())
