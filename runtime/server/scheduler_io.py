"""The scheduler process's messages in and out, for one rank of a tensor-parallel group.

Rank 0 (the only rank without tensor parallelism) receives from the tokenizer manager and
sends to the detokenizer and tokenizer manager over ZMQ. Under tensor parallelism it also
broadcasts each round of messages it received, with its clock, to the other ranks, which
run the same schedule on them and send nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

import zmq

from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.distributed.lockstep import TPLockstep
from kvflow.runtime.server.ipc import IpcPaths, Puller, Pusher

__all__ = ["SchedulerIO"]


class SchedulerIO:
    """``receive`` blocks (rank 0: up to ``wait_ms`` for a first message on ``inbox``, its
    data-parallel group's, or a :meth:`wake`; other ranks: for rank 0's round) and returns
    the same messages on every rank; the ``send_*`` methods send on rank 0 and do nothing
    elsewhere."""

    def __init__(
        self,
        inbox: str,
        paths: IpcPaths,
        tp: TPGroup | None = None,
        lockstep: TPLockstep | None = None,
    ) -> None:
        if (tp is None) != (lockstep is None):
            raise ValueError("a tensor-parallel rank needs both its group and its lockstep")
        self.tp, self.lockstep = tp, lockstep
        self.leader = tp is None or tp.is_first
        if self.leader:
            ctx = zmq.Context()
            self._inbox = Puller(ctx, inbox)
            self._to_detokenizer = Pusher(ctx, paths.to_detokenizer)
            self._to_tokenizer = Pusher(ctx, paths.to_tokenizer)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        if self.leader:
            self._poller.register(self._inbox.socket, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    def wake(self) -> None:
        """End :meth:`receive`'s wait now (or the next one's, if none is waiting); safe
        from any thread: what the role waits on outside the loop happened."""
        with contextlib.suppress(BlockingIOError):  # full: a wake is pending already
            os.write(self._wake_w, b"\0")

    def _wait(self, wait_ms: int) -> None:
        """Until a message or a :meth:`wake`, at most ``wait_ms``; then take the wakes."""
        if wait_ms > 0:
            self._poller.poll(wait_ms)
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)

    def receive(self, wait_ms: int, local: Sequence[Any] = ()) -> list[Any]:
        """This round's messages; ``local``: rank 0's own notes to put in the round after
        what it received (no wait when there are some)."""
        messages: list[Any] = []
        # the other ranks wait for rank 0's round; rank 0 does not wait with notes to send
        self._wait(wait_ms if self.leader and not local else 0)
        if self.leader:
            messages = self._inbox.recv_all() + list(local)
        if self.tp is None:
            return messages
        assert self.lockstep is not None
        round_ = (messages, time.monotonic()) if self.leader else None
        messages, now = self.tp.broadcast_object(round_)
        self.lockstep.tick(now)
        return messages

    def send_detokenizer(self, message: Any) -> None:
        if self.leader:
            self._to_detokenizer.send(message)

    def send_tokenizer(self, message: Any) -> None:
        if self.leader:
            self._to_tokenizer.send(message)
