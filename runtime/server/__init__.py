"""The serving runtime's processes: HTTP + TokenizerManager, Scheduler, Detokenizer."""

from kvflow.runtime.server.args import ServerArgs, parse_args
from kvflow.runtime.server.launch import launch_server

__all__ = ["ServerArgs", "launch_server", "parse_args"]
