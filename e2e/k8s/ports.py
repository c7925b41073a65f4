"""Free TCP ports on loopback."""

from __future__ import annotations

import contextlib
import socket

__all__ = ["free_ports"]


def free_ports(count: int) -> tuple[int, ...]:
    """`count` distinct ports that were free on 127.0.0.1 a moment ago.

    All sockets stay bound until every port is picked, so the ports differ; another
    process could still take one before its component binds it (rare on loopback).
    """
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return tuple(ports)
