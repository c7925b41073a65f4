"""``/load_lora_adapter`` off the scheduler's loop: the adapter's files are read on a
worker thread while the loop keeps stepping (a rank-64 adapter of an 8B model is 321 MB:
read between two steps, it stalled every request for its read time), and the adapter is
registered between two steps once read.

Under tensor parallelism every rank reads its own copy, and all ranks must register it in
the same round: rank 0 puts a :class:`LoraLoadReady` into the round of messages it
broadcasts once its own read has ended, and each rank then waits for its own read (started
in the same round, so about as far along) before the ranks agree on the outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvflow.runtime.lora import LoraAdapter, LoraManager

__all__ = ["AdapterLoads", "LoraLoadReady"]


@dataclass(frozen=True)
class LoraLoadReady:
    """In a round of scheduler messages: the read for load ``request_id`` has ended on
    rank 0; every rank finishes that load in this round."""

    request_id: str


class AdapterLoads:
    """The loads in flight on one rank, by the control request's id. One read at a time
    (a second waits behind the first), in the order asked; ``wake`` is called (from the
    reading thread) when a read ends, to end the loop's wait for messages."""

    def __init__(self, manager: LoraManager, wake: Callable[[], None]) -> None:
        self.manager = manager
        self.wake = wake
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvflow-lora-read")
        self._pending: dict[str, tuple[str, Future[LoraAdapter]]] = {}

    def start(self, request_id: str, name: str, path: str) -> None:
        """Start reading adapter ``name``; ValueError at once for a name loaded or being
        loaded (the read's own errors come from :meth:`finish`)."""
        if name in self.manager.adapters or any(n == name for n, _ in self._pending.values()):
            raise ValueError(f"a LoRA adapter named {name!r} is loaded already; unload it first")
        future = self._executor.submit(self.manager.read, name, path)
        future.add_done_callback(lambda _: self.wake())
        self._pending[request_id] = (name, future)

    def ready(self) -> list[LoraLoadReady]:
        """Rank 0: the loads whose read has ended (the round that carries them finishes
        them: :meth:`finish`)."""
        return [LoraLoadReady(rid) for rid, (_, f) in self._pending.items() if f.done()]

    def finish(self, request_id: str) -> LoraAdapter | str:
        """This rank's read of load ``request_id`` (waiting for it to end): the adapter, or
        why it was refused. The load is no longer in flight afterwards."""
        _, future = self._pending.pop(request_id)
        try:
            return future.result()
        except ValueError as err:
            return str(err)
        except Exception as err:  # an unreadable file: a refused load, not a dead loop
            return f"reading the adapter failed: {type(err).__name__}: {err}"
