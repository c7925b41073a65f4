"""CPU time used by a server's whole process tree, from ``/proc`` (Linux).

On a machine shared with other jobs a server's wall-clock throughput depends on the CPU
share it happens to get; the CPU seconds it burns per output token do much less, so the
report shows both. A server started with ``start_new_session=True`` leads its own session,
and every process it spawns (scheduler, detokenizer) stays in it unless it calls setsid.
"""

from __future__ import annotations

import os

__all__ = ["session_cpu_seconds"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def session_cpu_seconds(session_id: int) -> float | None:
    """User + system CPU seconds of the live processes in ``session_id``; None off Linux.

    Children that already exited and were reaped count through their parent's
    ``cutime``/``cstime``.
    """
    if not os.path.isdir("/proc"):
        return None
    ticks = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # Fields after the parenthesised command name; see proc(5).
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[3]) == session_id:  # field 6: session
            ticks += sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    return ticks / _TICKS
