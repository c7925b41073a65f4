"""Child processes die with the server: a ``kill -9`` of the HTTP process must not leave a
scheduler holding gigabytes of model and KV memory, nor a detokenizer, running on; and the
server names how a child ended (:func:`describe_exit`)."""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import threading
import time
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["describe_exit", "run_tied_to_parent"]

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


def run_tied_to_parent(parent_pid: int, target: str, *args: Any) -> Any:
    """Process entry point: tie this process's life to ``parent_pid``, then run ``target``
    (``"module:function"``, imported here: the parent never imports what its children run,
    the scheduler's torch above all)."""
    _die_with(parent_pid)
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(*args)


def describe_exit(proc: BaseProcess) -> str:
    """How a child ended: its exit code, or the signal that killed it (SIGKILL is what the
    kernel's out-of-memory killer sends, as in a container over its memory limit)."""
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            signame = signal.Signals(-code).name
        except ValueError:
            signame = f"signal {-code}"
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"{proc.name} was killed by {signame}{hint}"
    return f"{proc.name} exited with code {code}"
