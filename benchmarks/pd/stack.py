"""The processes of the comparison, all on 127.0.0.1: a prefill, a decode and a unified
``kvflow serve`` with the same flags, ``kvflow router`` in PD mode in front of the pair and
``kvflow router --worker-urls`` in front of the unified server (so both configurations pay
one router hop)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from router.procs import Launch, Started, started
from serving.servers import free_port

__all__ = ["Stack", "pd_stack"]


class Stack(NamedTuple):
    """Base URLs: ``pd`` and ``unified`` are the routers' (what clients use)."""

    pd: str
    unified: str
    prefill: str
    decode: str
    bootstrap_port: int
    servers: list[Started]  # prefill, decode, unified (for their pids)


def _serve(name: str, python: str, model: str, flags: list[str]) -> Launch:
    port = free_port()
    argv = [python, "-P", "-m", "kvflow", "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--model-path", model, *flags]
    return Launch(name, argv, f"http://127.0.0.1:{port}")


def _router(name: str, python: str, flags: list[str]) -> Launch:
    port = free_port()
    argv = [python, "-P", "-m", "kvflow", "router", "--host", "127.0.0.1", "--port", str(port)]
    return Launch(name, [*argv, *flags], f"http://127.0.0.1:{port}")


@contextmanager
def pd_stack(python: str, model: str, server_args: list[str], log_dir: Path) -> Iterator[Stack]:
    """Start everything (the three servers load in parallel), stop everything on exit."""
    bootstrap_port = free_port()
    servers = [
        _serve("prefill", python, model, ["--role", "prefill", "--bootstrap-port", str(bootstrap_port), *server_args]),
        _serve("decode", python, model, ["--role", "decode", "--disaggregation-trusted-prefills", f"127.0.0.1:{bootstrap_port}", *server_args]),
        _serve("unified", python, model, server_args),
    ]  # fmt: skip
    prefill, decode, unified = (s.base_url for s in servers)
    routers = [
        _router("router-pd", python, ["--prefill-urls", f"{prefill}#{bootstrap_port}", "--decode-urls", decode]),
        _router("router-unified", python, ["--worker-urls", unified]),
    ]  # fmt: skip
    with started(servers, log_dir) as running, started(routers, log_dir) as fronts:
        yield Stack(
            fronts[0].base_url, fronts[1].base_url, prefill, decode, bootstrap_port, running
        )
