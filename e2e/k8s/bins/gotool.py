"""Running the go command with kvflow's own module and build caches."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..env import K8sEnv
from ..log import elapsed, say
from .source import SourceUnavailable

__all__ = ["GoTool"]

_HEARTBEAT_S = 60.0


class GoTool:
    """The go command with GOPATH, GOMODCACHE and GOCACHE under `<cache>/go`.

    Keeping Go's caches next to the binary cache makes a rebuild after a version
    bump (or after the binaries were deleted) incremental: modules are not
    downloaded again and unchanged packages are not compiled again.
    """

    def __init__(self, env: K8sEnv) -> None:
        self.command = env.go
        self._go_dir = env.go_dir

    def environ(self, goflags: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            GOPATH=str(self._go_dir / "path"),
            GOMODCACHE=str(self._go_dir / "mod"),
            GOCACHE=str(self._go_dir / "build"),
            GOFLAGS=goflags,
        )
        return env

    def check(self) -> None:
        """Raise `SourceUnavailable` unless a working go command is at hand."""
        try:
            subprocess.run([self.command, "version"], capture_output=True, check=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as err:
            raise SourceUnavailable(f"no usable go command ({self.command}): {err}") from err

    def run(
        self,
        args: Sequence[str],
        *,
        cwd: Path,
        log: Path,
        what: str,
        goflags: str = "",
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        """Run `go <args>` with output to `log`, printing a heartbeat while it runs.

        Raises `SourceUnavailable` with the log's tail when go fails.
        """
        env = self.environ(goflags)
        env.update(extra_env or {})
        start = time.monotonic()
        with open(log, "ab") as out:
            proc = subprocess.Popen([self.command, *args], cwd=cwd, env=env, stdout=out, stderr=out)
            while True:
                try:
                    proc.wait(timeout=_HEARTBEAT_S)
                    break
                except subprocess.TimeoutExpired:
                    say(f"  still {what} ({elapsed(start)})")
        if proc.returncode != 0:
            tail = log.read_text(errors="replace").splitlines()[-30:]
            raise SourceUnavailable(
                f"go {args[0]} failed ({what}), exit {proc.returncode}; log {log}:\n"
                + "\n".join(tail)
            )
