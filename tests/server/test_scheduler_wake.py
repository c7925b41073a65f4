"""The scheduler loop's wait for messages and what ends it: a message, or a ``wake`` from
a thread of the role (a PD room's outcome, a claim, a write's end); and what a step
delays: nothing that was ready before it (a PD decode's first token)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from kvflow.runtime.server.ipc import make_ipc_paths
from kvflow.runtime.server.scheduler_io import SchedulerIO
from kvflow.runtime.server.scheduler_process import SchedulerLoop
from kvflow.runtime.wire import TokenOutput
from kvflow.runtime.wire.messages import TokenBatch

LONG_MS = 60_000  # a wait nobody ends would fail the bound below by far


def test_a_wake_from_another_thread_ends_the_wait_for_messages() -> None:
    paths = make_ipc_paths()
    io = SchedulerIO(paths.scheduler_inbox(0), paths)
    threading.Timer(0.1, io.wake).start()
    started = time.monotonic()
    assert io.receive(LONG_MS) == []
    assert time.monotonic() - started < LONG_MS / 1e3 / 2


def test_a_wake_before_the_wait_ends_the_next_wait_once() -> None:
    paths = make_ipc_paths()
    io = SchedulerIO(paths.scheduler_inbox(0), paths)
    for _ in range(3):  # several wakes before a wait: one wait ends, not three
        io.wake()
    started = time.monotonic()
    assert io.receive(LONG_MS) == []
    assert time.monotonic() - started < LONG_MS / 1e3 / 2
    assert io.receive(10) == []  # nothing pending: this one waits its 10 ms


class _Recorder:
    """Fakes of the loop's io, scheduler and role that log what happens, in order."""

    def __init__(self, ready: list[TokenOutput]) -> None:
        self.events: list[str] = []
        self.ready = ready

    # io
    leader = True

    def receive(self, wait_ms: int, local: list[object]) -> list[object]:
        return list(local)

    def send_detokenizer(self, batch: TokenBatch) -> None:
        self.events += [f"send {out.rid} {out.new_token_ids}" for out in batch.outputs]

    # scheduler
    def has_work(self) -> bool:
        return True

    def step(self) -> list[TokenOutput]:
        self.events.append("step")
        return [_out("joined", 8)]

    # role
    def poll(self) -> list[TokenOutput]:
        ready, self.ready = self.ready, []
        return ready

    def observe(self, outputs: list[TokenOutput]) -> list[TokenOutput]:
        return outputs

    def busy(self) -> bool:
        return False


def _out(rid: str, token: int) -> TokenOutput:
    return TokenOutput(rid, [token], None, 4, 1, 0)


def _loop(recorder: _Recorder) -> SchedulerLoop:
    loop = SchedulerLoop.__new__(SchedulerLoop)  # its parts only: no model, no sockets
    loop.io = loop.scheduler = loop.role = recorder  # type: ignore[assignment]
    loop.watchdog = SimpleNamespace(tick=lambda busy: None)  # type: ignore[assignment]
    loop._publish_stats = lambda force=False: None  # type: ignore[method-assign]
    loop.lora_loads = None  # (no --enable-lora)
    return loop


def test_a_first_token_ready_before_the_step_is_sent_before_it() -> None:
    """A PD decode's request joins the running batch with the prefill's first token (the
    role's poll): it goes out at once, not after the decode step that follows."""
    recorder = _Recorder(ready=[_out("joined", 7)])
    _loop(recorder).run_once()
    assert recorder.events == ["send joined [7]", "step", "send joined [8]"]


def test_without_anything_ready_a_step_sends_once() -> None:
    recorder = _Recorder(ready=[])
    _loop(recorder).run_once()
    assert recorder.events == ["step", "send joined [8]"]
