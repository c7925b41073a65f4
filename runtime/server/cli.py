"""``kvflow serve``."""

from __future__ import annotations

from kvflow.runtime.server.args import parse_args
from kvflow.runtime.server.launch import launch_server

__all__ = ["main"]


def main(argv: list[str]) -> int:
    return launch_server(parse_args(argv))
