"""CPU time of the server under test, and of everything else, from ``/proc`` (Linux).

On a machine shared with other jobs a server's wall-clock throughput depends on the CPU
share it happens to get. The report therefore shows the CPU seconds the server burns per
output token, and how busy the rest of the machine was during the run (other jobs' share
of all cores): a run with a large share is contaminated, whatever the load average says.

A server started with ``start_new_session=True`` leads its own session, and every process
it spawns (scheduler, detokenizer) stays in it unless it calls setsid.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

__all__ = ["CpuSample", "cpu_sample", "session_cpu_seconds"]

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


def _machine_busy_seconds() -> float | None:
    """CPU seconds all cores spent not idle since boot (``/proc/stat``)."""
    try:
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:]]
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user)
    return (sum(values[:8]) - values[3] - values[4]) / _TICKS


class CpuSample(NamedTuple):
    """A snapshot of cumulative CPU seconds; subtract two to get a run's usage."""

    at: float  # time.monotonic()
    machine: float | None  # all cores, busy
    server: float | None  # the server's session
    client: float  # this process (the load generator)

    def server_since(self, before: CpuSample) -> float | None:
        if self.server is None or before.server is None:
            return None
        return self.server - before.server

    def others_share_since(self, before: CpuSample) -> float | None:
        """Fraction (0-1) of all cores' time that other jobs used between the samples."""
        server = self.server_since(before)
        if self.machine is None or before.machine is None or server is None:
            return None
        wall = (self.at - before.at) * (os.cpu_count() or 1)
        others = (self.machine - before.machine) - server - (self.client - before.client)
        return max(0.0, others / wall) if wall > 0 else None


def cpu_sample(session_id: int) -> CpuSample:
    """Cumulative CPU seconds now: machine, the server's session, this process."""
    times = os.times()
    return CpuSample(
        time.monotonic(),
        _machine_busy_seconds(),
        session_cpu_seconds(session_id),
        times.user + times.system,
    )
