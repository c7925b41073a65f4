"""The servers the benchmark compares, and a context manager that runs one.

Each :class:`ServerSpec` says how to start the server on a port, how to tell it is ready,
what request fields make it produce exactly ``max_tokens`` tokens, and which workloads it
takes part in. Servers run one at a time, each in its own session (process group), with
output to a log file whose tail is shown when startup fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx

__all__ = [
    "SERVERS",
    "LaunchOptions",
    "RunningServer",
    "ServerSpec",
    "running_server",
    "select_servers",
]


@dataclass(frozen=True)
class LaunchOptions:
    """What every server is started with (the same model, the same dtype)."""

    model_path: str
    dtype: str | None = None  # None: each server's "auto" (SmolLM2's weights are float32)
    python: str = sys.executable
    extra_args: dict[str, list[str]] = field(default_factory=dict)  # server name -> flags


@dataclass(frozen=True)
class ServerSpec:
    """One server under test. ``argv(port, options)`` builds its command line."""

    name: str
    description: str
    argv: Callable[[int, LaunchOptions], list[str]]
    ready_paths: tuple[str, ...]  # GET; the first to answer 200 means ready
    extra_body: dict[str, Any]
    workloads: tuple[str, ...]
    eos_note: str  # how exact output lengths are obtained, for the report


def _transformers_argv(port: int, opts: LaunchOptions) -> list[str]:
    exe = str(Path(opts.python).with_name("transformers"))
    dtype = ["--dtype", opts.dtype] if opts.dtype else []
    return [
        exe,
        "serve",
        "--continuous-batching",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *dtype,
        *opts.extra_args.get("transformers", []),
        opts.model_path,
    ]


def _kvflow_argv(*flags: str) -> Callable[[int, LaunchOptions], list[str]]:
    def argv(port: int, opts: LaunchOptions) -> list[str]:
        dtype = ["--dtype", opts.dtype] if opts.dtype else []
        return [
            opts.python,
            "-m",
            "kvflow",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model-path",
            opts.model_path,
            *dtype,
            *flags,
            *opts.extra_args.get("kvflow", []),
        ]

    return argv


# NOTE: transformers serve answers 422 to unknown body fields (so no ``ignore_eos``), but it
# accepts a ``generation_config`` JSON string; with ``eos_token_id: -1`` its continuous
# batching manager stops on length only. ``do_sample: false`` matches temperature 0.
_HF_NO_EOS = json.dumps({"eos_token_id": -1, "do_sample": False})

SERVERS: dict[str, ServerSpec] = {
    spec.name: spec
    for spec in (
        ServerSpec(
            "transformers",
            "transformers serve --continuous-batching",
            _transformers_argv,
            ("/health", "/v1/models"),
            {"generation_config": _HF_NO_EOS},
            ("fixed",),
            f"`generation_config: '{_HF_NO_EOS}'` (no `ignore_eos` field: 422)",
        ),
        ServerSpec(
            "kvflow",
            "kvflow serve",
            _kvflow_argv(),
            ("/health",),
            {"ignore_eos": True},
            ("fixed", "shared"),
            "`ignore_eos: true`",
        ),
        ServerSpec(
            "kvflow-mixed",
            "kvflow serve --enable-mixed-chunk",
            _kvflow_argv("--enable-mixed-chunk"),
            ("/health",),
            {"ignore_eos": True},
            ("fixed",),
            "`ignore_eos: true`",
        ),
        ServerSpec(
            "kvflow-no-radix",
            "kvflow serve --disable-radix-cache",
            _kvflow_argv("--disable-radix-cache"),
            ("/health",),
            {"ignore_eos": True},
            ("shared",),
            "`ignore_eos: true`",
        ),
    )
}


class RunningServer(NamedTuple):
    """A started server: where to send requests, and its session (its process tree)."""

    base_url: str
    session_id: int


def select_servers(only: list[str] | None) -> list[ServerSpec]:
    """Servers named in ``only`` (``kvflow`` also selects ``kvflow-no-radix``); all if None."""
    if not only:
        return list(SERVERS.values())
    unknown = [
        name for name in only if not any(s == name or s.startswith(name + "-") for s in SERVERS)
    ]
    if unknown:
        raise SystemExit(f"unknown server(s) {unknown}; choose from {list(SERVERS)}")
    return [
        s for s in SERVERS.values() if any(s.name == n or s.name.startswith(n + "-") for n in only)
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(
    base_url: str, paths: tuple[str, ...], proc: subprocess.Popen, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming ready")
        for path in paths:
            try:
                if httpx.get(base_url + path, timeout=5, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(1.0)
    raise TimeoutError(f"server not ready after {timeout:.0f} s")


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the server (it drains and reaps its children), then SIGKILL its group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    with suppress(ProcessLookupError):  # the session this module started: leftovers only
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextmanager
def running_server(
    spec: ServerSpec, opts: LaunchOptions, log_path: Path, ready_timeout: float = 600.0
) -> Iterator[RunningServer]:
    """Start ``spec`` on a free port, yield it once ready, stop it on exit."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    argv = spec.argv(port, opts)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write(" ".join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            try:
                _wait_ready(base_url, spec.ready_paths, proc, ready_timeout)
            except (RuntimeError, TimeoutError) as exc:
                tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-30:])
                raise RuntimeError(f"{spec.name}: {exc}; log {log_path}:\n{tail}") from exc
            yield RunningServer(base_url, proc.pid)  # a new session's id is its leader's pid
        finally:
            _stop(proc, grace=30.0)
