"""``/load_lora_adapter`` off the scheduler's loop: the adapter's files are read on a
thread while the loop keeps stepping (a rank-64 adapter of an 8B model is 321 MB: read
between two steps, it stalled every request for its read time), and the adapter is
registered between two steps once read.

Each read has a thread of its own, so a read that never ends (a stalled network mount, a
FIFO nobody writes) holds up no other load; and a load whose read has not ended
``read_timeout_s`` after it started is refused (``$KVFLOW_LORA_READ_TIMEOUT_S``, 300 s by
default), so its client gets an answer in bounded time. The stuck thread is a daemon: it
keeps nothing from exiting, and whatever it reads later is dropped.

Under tensor parallelism every rank reads its own copy, and all ranks must register it in
the same round: rank 0 puts a :class:`LoraLoadReady` into the round of messages it
broadcasts once its own read has ended (or its time is up: ``expired``), and each rank
then waits for its own read (started in the same round, so about as far along) before the
ranks agree on the outcome; an expired load is refused on every rank without waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from kvflow.contract import LORA_READ_TIMEOUT_ENV
from kvflow.runtime.lora import LoraAdapter, LoraManager

__all__ = ["AdapterLoads", "LoraLoadReady"]


@dataclass(frozen=True)
class LoraLoadReady:
    """In a round of scheduler messages: the read for load ``request_id`` has ended on
    rank 0 (or, ``expired``, did not end in time); every rank finishes that load in this
    round."""

    request_id: str
    expired: bool = False


@dataclass(frozen=True)
class _Load:
    name: str
    read: Future[LoraAdapter]
    deadline: float  # time.monotonic() by which the read must have ended


class AdapterLoads:
    """The loads in flight on one rank, by the control request's id; ``wake`` is called
    (from the reading thread) when a read ends, to end the loop's wait for messages."""

    def __init__(
        self, manager: LoraManager, wake: Callable[[], None], read_timeout_s: float = 300.0
    ) -> None:
        self.manager = manager
        self.wake = wake
        self.read_timeout_s = read_timeout_s
        self._pending: dict[str, _Load] = {}

    def start(self, request_id: str, name: str, path: str) -> None:
        """Start reading adapter ``name``; ValueError at once for a name loaded or being
        loaded (the read's own errors come from :meth:`finish`)."""
        if name in self.manager.adapters or any(ld.name == name for ld in self._pending.values()):
            raise ValueError(f"a LoRA adapter named {name!r} is loaded already; unload it first")
        read: Future[LoraAdapter] = Future()

        def run() -> None:
            try:
                read.set_result(self.manager.read(name, path))
            except BaseException as err:  # (handed to finish, which words it)
                read.set_exception(err)
            self.wake()

        deadline = time.monotonic() + self.read_timeout_s
        self._pending[request_id] = _Load(name, read, deadline)
        threading.Thread(target=run, name=f"kvflow-lora-read-{request_id}", daemon=True).start()

    def ready(self) -> list[LoraLoadReady]:
        """Rank 0: the loads whose read has ended or whose time is up (the round that
        carries them finishes them: :meth:`finish`)."""
        now = time.monotonic()
        return [
            LoraLoadReady(rid, expired=not load.read.done())
            for rid, load in self._pending.items()
            if load.read.done() or now >= load.deadline
        ]

    def finish(self, request_id: str, expired: bool = False) -> LoraAdapter | str:
        """This rank's read of load ``request_id`` (waiting for it to end, unless rank 0
        found it ``expired``): the adapter, or why it was refused. The load is no longer in
        flight afterwards."""
        load = self._pending.pop(request_id)
        if expired:
            return (
                f"reading LoRA adapter {load.name!r} did not end within "
                f"{self.read_timeout_s:g} s (${LORA_READ_TIMEOUT_ENV}); nothing was loaded"
            )
        try:
            return load.read.result()
        except ValueError as err:
            return str(err)
        except Exception as err:  # an unreadable file: a refused load, not a dead loop
            return f"reading the adapter failed: {type(err).__name__}: {err}"
