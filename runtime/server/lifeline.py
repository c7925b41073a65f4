"""Child processes die with the server: a ``kill -9`` of the HTTP process must not leave a
scheduler holding gigabytes of model and KV memory, nor a detokenizer, running on."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["run_tied_to_parent"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 1.0


def _die_with(parent_pid: int) -> None:
    """Get SIGKILL when the parent exits (Linux ``prctl``), else poll for it; exit now if it
    is gone already (it may have died before this process got here)."""
    armed = False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if os.getppid() != parent_pid:
        os._exit(1)
    if not armed:
        threading.Thread(target=_watch, args=(parent_pid,), daemon=True).start()


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_POLL_S)
    os._exit(1)


def run_tied_to_parent(parent_pid: int, target: Callable[..., Any], *args: Any) -> Any:
    """Process entry point: tie this process's life to ``parent_pid``, then run ``target``."""
    _die_with(parent_pid)
    return target(*args)
