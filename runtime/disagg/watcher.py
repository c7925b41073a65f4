"""The decode side's links to the prefills: one thread per prefill (bootstrap address),
started when a request names it and ended once it has nothing to watch, that registers
there, claims rooms and polls their states in batches.

The scheduler loop never waits on the network, and a prefill that is slow, silent or
hostile delays only its own rooms: each link waits on its own prefill, each call within
its own deadline (see :class:`~kvflow.runtime.disagg.bootstrap_client.BootstrapClient`).
At most ``max_peers`` prefills are watched at once; a request naming one more fails at
once, saying so.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from kvflow.runtime.disagg.bootstrap_client import BootstrapClient, BootstrapError, RoomReport
from kvflow.runtime.disagg.layout import KVLayout
from kvflow.runtime.disagg.ranks import Endpoint
from kvflow.runtime.disagg.rooms import FINAL_STATES
from kvflow.runtime.wire import Bootstrap

__all__ = ["MAX_PEERS", "RoomWatcher"]
logger = logging.getLogger("kvflow.decode")
_POLL_S = 0.005  # between polls that heard nothing at once (the prefill did not wait)
_WAIT_MS = 100  # a poll waits at the prefill up to this long for one of its rooms to end
_CALL_TIMEOUT_S = 2.0  # one bootstrap call (the rooms fail after the longer timeout_s)
_IDLE_S = 10.0  # a link with nothing to watch ends after this
MAX_PEERS = 64  # prefills watched at once


class _Pending(NamedTuple):
    key: str
    bootstrap: Bootstrap
    slots: list[int]
    prompt_hash: str


class RoomWatcher:
    """Claims and polls rooms for the decode; how each ended (a :class:`RoomReport` in a
    final state: ``done`` with the prefill's result, ``failed`` or ``cancelled`` with a
    message) comes back through :meth:`done`.

    A prefill that cannot be reached (or answers nonsense) for ``timeout_s`` fails all its
    rooms: a dead prefill writes nothing more, so their slots may be reused. Under tensor
    parallelism it runs on rank 0 and registers every rank (``tp_ranks``: ranks 1 ..).
    """

    def __init__(
        self,
        session: str,
        layout: KVLayout,
        timeout_s: float,
        key: str | None = None,
        max_peers: int = MAX_PEERS,
        peer_info: dict[str, Any] | None = None,
        tp_ranks: tuple[Endpoint, ...] = (),
        on_outcome: Callable[[], None] | None = None,
    ) -> None:
        self.session = session
        self.on_outcome = on_outcome  # called (from any thread) once an outcome is queued
        self.layout = layout
        self.peer_info = peer_info  # the transport's, sent with every registration
        self.tp_ranks = tp_ranks
        self.timeout_s = timeout_s
        self.key = key
        self.max_peers = max_peers
        self._outbox: queue.Queue[tuple[str, RoomReport]] = queue.Queue()
        self._links: dict[str, _PeerLink] = {}  # bootstrap address -> its link
        self._lock = threading.Lock()  # _links, and a link's inbox while it may end

    # -- the scheduler loop's side ---------------------------------------------------------
    def claim(self, key: str, bootstrap: Bootstrap, slots: list[int], prompt_hash: str) -> None:
        address = bootstrap.address
        with self._lock:
            link = self._links.get(address)
            if link is None:
                if len(self._links) >= self.max_peers:
                    why = f"the decode watches {self.max_peers} prefills already (the limit)"
                    self.fail(key, why)
                    return
                link = self._links[address] = _PeerLink(self, address)
                link.start()
            link.inbox.put(("claim", _Pending(key, bootstrap, slots, prompt_hash)))

    def cancel(self, bootstrap: Bootstrap) -> None:
        with self._lock:
            link = self._links.get(bootstrap.address)
            if link is not None:  # none: the room ended already (its outcome is queued)
                link.inbox.put(("cancel", bootstrap.room))

    def done(self) -> list[tuple[str, RoomReport]]:
        out = []
        while True:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                return out

    def peers(self) -> int:
        """Prefills watched now (a link each)."""
        with self._lock:
            return len(self._links)

    # -- the links' side -------------------------------------------------------------------
    def fail(self, key: str, message: str) -> None:
        self.finish(key, RoomReport("failed", {}, message))

    def finish(self, key: str, outcome: RoomReport) -> None:
        self._outbox.put((key, outcome))
        if self.on_outcome is not None:
            self.on_outcome()

    def retire(self, link: _PeerLink) -> bool:
        """End an idle link unless work reached it meanwhile (then False)."""
        with self._lock:
            if not link.inbox.empty():
                return False
            del self._links[link.address]
            return True


class _PeerLink(threading.Thread):
    """The rooms claimed at one prefill, and the thread that waits on it."""

    def __init__(self, watcher: RoomWatcher, address: str) -> None:
        super().__init__(name=f"kvflow-rooms-{address}", daemon=True)
        self.watcher = watcher
        self.address = address
        call_timeout_s = min(_CALL_TIMEOUT_S, watcher.timeout_s)
        self.client = BootstrapClient(address, call_timeout_s, key=watcher.key)
        self.wait_ms = min(_WAIT_MS, int(call_timeout_s * 1e3 / 4))  # well inside a call
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.watched: dict[int, str] = {}  # room -> the decode's key
        self.cancels: list[int] = []
        self.withdrawn: dict[int, str] = {}  # room -> why its claim failed (see _withdraw)
        self.registered = False
        self.last_ok = 0.0

    def run(self) -> None:
        idle_since = time.monotonic()
        pause = 0.0  # before the next poll (see _poll)
        while True:
            try:
                items = [self.inbox.get(timeout=max(pause, 1e-4) if self.watched else 0.5)]
                while not self.inbox.empty():
                    items.append(self.inbox.get_nowait())
            except queue.Empty:
                items = []
            pending = [item for kind, item in items if kind == "claim"]
            self.cancels += [item for kind, item in items if kind == "cancel"]
            # NOTE: an unexpected error fails the rooms it concerns instead of ending the
            # thread (every room of this prefill would hang)
            if pending:
                try:
                    self._claim(pending)
                except Exception as err:
                    logger.exception("claiming rooms at %s failed", self.address)
                    watched = set(self.watched.values())
                    for p in pending:
                        if p.key not in watched:
                            self.watcher.fail(p.key, f"claim at {self.address} failed: {err}")
            if self.watched:
                try:
                    pause = self._poll()
                except Exception as err:
                    logger.exception("polling rooms at %s failed", self.address)
                    for key in self.watched.values():
                        self.watcher.fail(key, f"status at {self.address} failed: {err}")
                    self.watched.clear()
                    self.withdrawn.clear()
            else:
                self.cancels.clear()  # no room left here to cancel
            now = time.monotonic()
            if items or self.watched:
                idle_since = now
            elif now - idle_since > _IDLE_S and self.watcher.retire(self):
                return

    def _register(self) -> None:
        watcher = self.watcher
        self.client.register(watcher.session, watcher.layout, watcher.peer_info, watcher.tp_ranks)
        self.registered = True
        self.last_ok = time.monotonic()

    def _claim(self, pending: list[_Pending]) -> None:
        rooms = set(self.watched)
        for p in list(pending):  # one key per room: a second one would never hear back
            if p.bootstrap.room in rooms:
                pending.remove(p)
                self.watcher.fail(p.key, f"bootstrap room {p.bootstrap.room} is in use here")
            rooms.add(p.bootstrap.room)
        if not pending:
            return
        claims = [(p.bootstrap.room, p.slots, p.prompt_hash) for p in pending]
        try:
            if not self.registered:
                self._register()
        except BootstrapError as err:  # nothing was claimed
            for p in pending:
                self.watcher.fail(p.key, str(err))
            return
        try:
            try:
                refused = self.client.claim(self.watcher.session, claims)
            except BootstrapError as err:
                if not err.refused:
                    raise
                self._register()  # the prefill restarted: register again
                refused = self.client.claim(self.watcher.session, claims)
        except BootstrapError as err:
            self.registered = False
            for p in pending:
                if err.refused:  # answered: nothing was claimed
                    self.watcher.fail(p.key, str(err))
                else:
                    self._withdraw(p, str(err))
            return
        self.last_ok = time.monotonic()
        for p in pending:
            if p.bootstrap.room in refused:
                self.watcher.fail(p.key, refused[p.bootstrap.room])
            else:
                self.watched[p.bootstrap.room] = p.key

    def _withdraw(self, pending: _Pending, why: str) -> None:
        """A claim whose call failed without an answer may have reached the prefill, which
        would write into the slots later: watch its room cancelled, so the slots are reused
        only once the prefill says the room ended (or is gone for the timeout)."""
        room = pending.bootstrap.room
        self.watched[room] = pending.key
        self.cancels.append(room)
        self.withdrawn[room] = why

    def _poll(self) -> float:
        """Ask for the watched rooms' states, the prefill waiting until one ends (unless
        claims are queued here: they go first); returns how long to pause before the next
        poll: none after news or a wait, the rest of :data:`_POLL_S` after an answer that
        came at once without news (a prefill that does not wait, or one with a room
        waiting for its claim), so a peer is never asked in a busy loop."""
        cancels, self.cancels = self.cancels, []
        wait_ms = self.wait_ms if self.inbox.empty() else 0
        asked_at = time.monotonic()
        try:
            reports = self.client.status(list(self.watched), cancels, wait_ms)
        except BootstrapError as err:
            self.cancels = cancels + self.cancels
            if time.monotonic() - self.last_ok > self.watcher.timeout_s:
                for room, key in self.watched.items():
                    why = self.withdrawn.pop(room, f"{err} for {self.watcher.timeout_s:.0f} s")
                    self.watcher.fail(key, why)
                self.watched.clear()
            return _POLL_S
        self.last_ok = time.monotonic()
        heard = any(r.state in FINAL_STATES or r.state == "unknown" for r in reports.values())
        self._report(reports)
        return 0.0 if heard else max(0.0, _POLL_S - (self.last_ok - asked_at))

    def _report(self, reports: dict[int, RoomReport]) -> None:
        for room, report in reports.items():
            if report.state == "unknown":
                report = RoomReport("failed", {}, "the prefill lost the room (restarted?)")
            if report.state in FINAL_STATES:
                why = self.withdrawn.pop(room, "")
                if why:  # ended after a failed claim: failed, whatever it says
                    report = RoomReport("failed", {}, why)
                self.watcher.finish(self.watched.pop(room), report)
