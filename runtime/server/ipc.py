"""Typed ZMQ PUSH/PULL wrappers over ``ipc://`` sockets in a private directory."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from kvflow.runtime.wire.messages import dumps, loads

__all__ = ["IpcPaths", "Puller", "Pusher", "make_ipc_paths", "remove_ipc_paths"]


@dataclass(frozen=True)
class IpcPaths:
    """Socket addresses of one runtime instance (one per receiving side)."""

    to_scheduler: str
    to_detokenizer: str
    to_tokenizer: str

    def scheduler_inbox(self, dp_rank: int) -> str:
        """Where data-parallel group ``dp_rank``'s scheduler (its rank 0) receives."""
        return self.to_scheduler if dp_rank == 0 else f"{self.to_scheduler}-dp{dp_rank}"


def make_ipc_paths() -> IpcPaths:
    # A private 0700 directory: other users cannot connect to the sockets.
    folder = Path(tempfile.mkdtemp(prefix="kvflow-ipc-"))
    return IpcPaths(
        *(f"ipc://{folder / name}" for name in ("scheduler", "detokenizer", "tokenizer"))
    )


def remove_ipc_paths(paths: IpcPaths) -> None:
    """Deletes the private directory of ``paths`` (its socket files), once no process uses it."""
    folder = Path(paths.to_scheduler.removeprefix("ipc://")).parent
    if folder.name.startswith("kvflow-ipc-"):
        shutil.rmtree(folder, ignore_errors=True)


class Pusher:
    """Sends messages; connects to the receiver's bound address."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def send(self, message: object) -> None:
        self.socket.send(dumps(message), copy=False)


class Puller:
    """Receives messages on a bound address (blocking or polling)."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """One message, waiting up to ``timeout_ms`` (None: forever). None on timeout."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return loads(self.socket.recv())

    def recv_all(self) -> list[Any]:
        """Every message already waiting, without blocking."""
        messages = []
        while self.socket.poll(0):
            messages.append(loads(self.socket.recv()))
        return messages

    async def recv_async(self) -> Any:
        assert isinstance(self.socket, zmq.asyncio.Socket)
        return loads(await self.socket.recv())
