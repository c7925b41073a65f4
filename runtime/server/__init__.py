"""The serving runtime's processes: HTTP + TokenizerManager, Scheduler, Detokenizer.

Exports load lazily: a child process imports only what it runs (the detokenizer's never
imports torch), which is start-up time on a machine of few cores."""

from typing import TYPE_CHECKING, Any

__all__ = ["ServerArgs", "launch_server", "parse_args"]

if TYPE_CHECKING:
    from kvflow.runtime.server.args import ServerArgs, parse_args
    from kvflow.runtime.server.launch import launch_server

_LAZY = {
    "ServerArgs": "kvflow.runtime.server.args",
    "parse_args": "kvflow.runtime.server.args",
    "launch_server": "kvflow.runtime.server.launch",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvflow.runtime.server' has no attribute {name!r}")
