"""The prefill side's table of bootstrap rooms: who claimed a room, and how far it got.

A room pairs the two halves of one request. The decode claims it (its KV session and the
slots the prompt's KV goes to); the prefill's request with the same room passes through
the states below; the decode polls until a final state and the entry is then dropped::

    waiting (claimed, no request yet) --request--> queued --prefilled--> ready
    queued (request, no claim yet)    --claim--/
    ready --transfer--> transferring --> done | failed
    queued + claimed --first chunk written--> transferring (the prompt's later chunks follow)
    any state --cancel--> cancelled (after a transfer in flight has ended)
    waiting or ready for longer than the timeout (the bootstrap timeout) --> failed

Thread-safe: the bootstrap HTTP server's threads and the scheduler loop share it. A
status call may wait (``wait_s``) until one of its rooms ends, so the decode hears of it
at once instead of at its next poll.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FINAL_STATES", "Claim", "Room", "Rooms"]

FINAL_STATES = frozenset({"done", "failed", "cancelled"})
_KEEP_FINAL_S = 60.0  # a final state nobody polls is dropped after this


@dataclass(frozen=True)
class Claim:
    """What the decode said about a room: where its KV goes, and which prompt it holds
    (the prefill sends the KV only if that is its request's prompt)."""

    session: str  # the decode's transport session ("host:port")
    slots: tuple[int, ...]  # the decode's KV slots for prompt positions 0..len-1
    prompt_hash: str  # kvflow.runtime.wire.disagg.prompt_hash of the decode's prompt


@dataclass
class Room:
    room: int
    state: str
    claim: Claim | None = None
    result: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    cancelled: bool = False
    since: float = field(default_factory=time.monotonic)

    def report(self) -> dict[str, Any]:
        return {"state": self.state, "result": self.result, "message": self.message}


class Rooms:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._rooms: dict[int, Room] = {}
        self._lock = threading.Lock()
        # notified when a room ends or one arrives unclaimed (under _lock; see status)
        self._changed = threading.Condition(self._lock)

    def _move(self, room: Room, state: str, message: str = "") -> None:
        room.state, room.message, room.since = state, message, time.monotonic()
        if state in FINAL_STATES:
            self._changed.notify_all()

    def _settled(self, room_ids: list[int]) -> bool:
        """Whether a waiting status call answers now: one of its rooms ended (or is
        unknown), or a room waits for a claim (perhaps one its decode holds back while
        this call waits)."""
        for room_id in room_ids:
            room = self._rooms.get(room_id)
            if room is None or room.state in FINAL_STATES:
                return True
        return any(r.claim is None and r.state not in FINAL_STATES for r in self._rooms.values())

    # -- the decode's side (bootstrap server threads) -------------------------------------
    def claim(self, room_id: int, claim: Claim) -> str | None:
        """Record the decode's claim; an error message if the room is claimed already."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                self._rooms[room_id] = Room(room_id, "waiting", claim)
                return None
            if room.claim is not None:
                return f"bootstrap room {room_id} is claimed already"
            if room.state in FINAL_STATES:  # the prefill gave up on it first
                why = f"{room.state}: {room.message}" if room.message else room.state
                return f"bootstrap room {room_id} ended before the decode claimed it ({why})"
            room.claim = claim
            return None

    def status(
        self, room_ids: list[int], cancel: list[int], wait_s: float = 0.0
    ) -> dict[int, dict[str, Any]]:
        """Cancel ``cancel``, then report every room of ``room_ids``; final states are
        reported once and dropped. With ``wait_s``, first wait up to that long for one of
        ``room_ids`` to end (or for a room to arrive unclaimed: its decode's claim may be
        waiting for this call to return)."""
        with self._lock:
            for room_id in cancel:
                room = self._rooms.get(room_id)
                if room is not None and room.state not in FINAL_STATES:
                    room.cancelled = True
                    if room.state != "transferring":
                        self._move(room, "cancelled", "cancelled by the decode")
            if wait_s > 0:
                self._changed.wait_for(lambda: self._settled(room_ids), wait_s)
            out = {}
            for room_id in room_ids:
                room = self._rooms.get(room_id)
                if room is None:
                    out[room_id] = {"state": "unknown", "result": {}, "message": ""}
                    continue
                out[room_id] = room.report()
                if room.state in FINAL_STATES:
                    del self._rooms[room_id]
            return out

    # -- the prefill's side (scheduler loop) ----------------------------------------------
    def arrive(self, room_id: int) -> str | None:
        """The prefill request of a room arrived; an error message if the room has one."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                self._rooms[room_id] = Room(room_id, "queued")
                self._changed.notify_all()  # a status call waiting may hold back its claim
                return None
            if room.state != "waiting":
                return f"bootstrap room {room_id} is in use ({room.state})"
            self._move(room, "queued")
            return None

    def refuse(self, room_id: int, message: str) -> None:
        """The room's prefill request was refused before it could arrive: the room fails
        (created failed if the decode has not claimed it yet; one another request holds
        is left alone)."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                self._rooms[room_id] = Room(room_id, "failed", message=message)
                self._changed.notify_all()
            elif room.state == "waiting":
                self._move(room, "failed", message)

    def ready(self, room_id: int) -> None:
        with self._lock:
            room = self._rooms.get(room_id)
            if room is not None and room.state == "queued":
                self._move(room, "ready")

    def take_claim(self, room_id: int) -> Claim | str | None:
        """For a ready room: its claim (the room moves to ``transferring``), a reason to give
        up (cancelled, gone, or unclaimed past the timeout; the room is failed), or None
        to wait."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.state in FINAL_STATES:
                return "the room was dropped" if room is None else room.state
            if room.cancelled:
                return "cancelled by the decode"
            if room.claim is None:
                if time.monotonic() - room.since > self.timeout_s:
                    reason = f"no decode claimed the room within {self.timeout_s:.0f} s"
                    self._move(room, "failed", reason)
                    return reason
                return None
            self._move(room, "transferring")
            return room.claim

    def start_early(self, room_id: int) -> Claim | None:
        """For a room whose request is still being prefilled (``queued``): its claim, if the
        decode made one and did not cancel (the room moves to ``transferring``, so a cancel
        now waits for the writes in flight); None to go on without sending yet."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.state != "queued" or room.claim is None or room.cancelled:
                return None
            self._move(room, "transferring")
            return room.claim

    def finish(self, room_id: int, state: str, result: dict[str, Any], message: str = "") -> None:
        """Final state of a room this side worked on (a cancel during transfer wins; a
        room that ended already keeps how it ended)."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.state in FINAL_STATES:
                return
            if room.cancelled and state == "done":
                state, message = "cancelled", "cancelled by the decode"
            room.result = result
            self._move(room, state, message)

    def expire(self) -> None:
        """Fail claims whose request never came; drop final states nobody polled."""
        now = time.monotonic()
        with self._lock:
            for room_id, room in list(self._rooms.items()):
                age = now - room.since
                if room.state == "waiting" and age > self.timeout_s:
                    reason = f"the prefill request of room {room_id} did not arrive in time"
                    self._move(room, "failed", reason)
                elif room.state in FINAL_STATES and age > _KEEP_FINAL_S:
                    del self._rooms[room_id]

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)
