"""The decode side's link to the prefills: one thread that registers with each prefill's
bootstrap endpoint, claims rooms and polls their states in batches, so the scheduler loop
never waits on the network."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from typing import Any, NamedTuple

from kvflow.runtime.disagg.bootstrap import BootstrapClient, BootstrapError
from kvflow.runtime.disagg.layout import KVLayout
from kvflow.runtime.disagg.rooms import FINAL_STATES
from kvflow.runtime.wire import Bootstrap

__all__ = ["Outcome", "RoomWatcher"]
logger = logging.getLogger("kvflow.decode")
_POLL_S = 0.005


class Outcome(NamedTuple):
    """How a room ended: ``done`` (``result`` has the first token), ``failed`` or
    ``cancelled`` (``message`` says why)."""

    state: str
    result: dict[str, Any]
    message: str


class _Pending(NamedTuple):
    key: str
    bootstrap: Bootstrap
    slots: list[int]


class RoomWatcher(threading.Thread):
    """Claims and polls rooms for the decode; results come back through :meth:`done`.

    A prefill that cannot be reached for ``timeout_s`` fails all its rooms: a dead prefill
    writes nothing more, so their slots may be reused.
    """

    def __init__(self, session: str, layout: KVLayout, timeout_s: float) -> None:
        super().__init__(name="kvflow-room-watcher", daemon=True)
        self.session = session
        self.layout = layout
        self.timeout_s = timeout_s
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._outbox: queue.Queue[tuple[str, Outcome]] = queue.Queue()
        self._clients: dict[str, BootstrapClient] = {}
        self._registered: set[str] = set()
        self._watched: dict[str, dict[int, str]] = defaultdict(dict)  # address -> room -> key
        self._cancels: dict[str, list[int]] = defaultdict(list)
        self._last_ok: dict[str, float] = {}

    # -- the scheduler loop's side ---------------------------------------------------------
    def claim(self, key: str, bootstrap: Bootstrap, slots: list[int]) -> None:
        self._inbox.put(("claim", _Pending(key, bootstrap, slots)))

    def cancel(self, bootstrap: Bootstrap) -> None:
        self._inbox.put(("cancel", bootstrap))

    def done(self) -> list[tuple[str, Outcome]]:
        out = []
        while True:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                return out

    # -- the thread ------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            claims: dict[str, list[_Pending]] = defaultdict(list)
            try:
                first = self._inbox.get(timeout=_POLL_S if self._watched else 0.2)
                items = [first]
                while not self._inbox.empty():
                    items.append(self._inbox.get_nowait())
            except queue.Empty:
                items = []
            for kind, item in items:
                if kind == "claim":
                    claims[item.bootstrap.address].append(item)
                else:
                    self._cancels[item.address].append(item.room)
            for address, pending in claims.items():
                try:
                    self._claim(address, pending)
                except Exception as err:  # never end the thread: every room would hang
                    logger.exception("claiming rooms at %s failed", address)
                    for p in pending:
                        self._fail(p.key, f"claim at {address} failed: {err}")
            for address in list(self._watched):
                try:
                    self._poll(address)
                except Exception as err:
                    logger.exception("polling rooms at %s failed", address)
                    for key in self._watched.pop(address, {}).values():
                        self._fail(key, f"status at {address} failed: {err}")

    def _client(self, address: str) -> BootstrapClient:
        if address not in self._clients:
            self._clients[address] = BootstrapClient(address)
        return self._clients[address]

    def _fail(self, key: str, message: str) -> None:
        self._outbox.put((key, Outcome("failed", {}, message)))

    def _claim(self, address: str, pending: list[_Pending]) -> None:
        client = self._client(address)
        claims = [(p.bootstrap.room, p.slots) for p in pending]
        try:
            if address not in self._registered:
                client.register(self.session, self.layout)
                self._registered.add(address)
            try:
                refused = client.claim(self.session, claims)
            except BootstrapError as err:
                if not err.refused:
                    raise
                self._registered.discard(address)  # the prefill restarted: register again
                client.register(self.session, self.layout)
                self._registered.add(address)
                refused = client.claim(self.session, claims)
        except BootstrapError as err:
            for p in pending:
                self._fail(p.key, str(err))
            return
        self._last_ok[address] = time.monotonic()
        for p in pending:
            if p.bootstrap.room in refused:
                self._fail(p.key, refused[p.bootstrap.room])
            else:
                self._watched[address][p.bootstrap.room] = p.key

    def _poll(self, address: str) -> None:
        watched = self._watched[address]
        cancels = self._cancels.pop(address, [])
        if not watched:
            del self._watched[address]
            return
        try:
            states = self._client(address).status(list(watched), cancels)
        except BootstrapError as err:
            self._cancels[address].extend(cancels)
            if time.monotonic() - self._last_ok.get(address, 0.0) > self.timeout_s:
                for key in watched.values():
                    self._fail(key, f"{err} for {self.timeout_s:.0f} s")
                del self._watched[address]
            return
        self._last_ok[address] = time.monotonic()
        for room, report in states.items():
            state = report["state"]
            if state == "unknown":
                state, report = "failed", {"message": "the prefill lost the room (restarted?)"}
            if state in FINAL_STATES:
                key = watched.pop(room)
                outcome = Outcome(state, report.get("result") or {}, report.get("message", ""))
                self._outbox.put((key, outcome))
