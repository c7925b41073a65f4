"""The decode's client of one prefill's bootstrap endpoint (routes: see
:mod:`kvflow.runtime.disagg.bootstrap`).

The prefill is a peer, not a part of this process: every call ends within ``timeout_s``
whatever it does (refuses, never answers, drips bytes, answers gigabytes), and every
answer is checked before anything of it is used. A call that fails raises
:class:`BootstrapError`, nothing else.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvflow.runtime.disagg.bootstrap import MAX_BODY_BYTES
from kvflow.runtime.disagg.layout import KVLayout
from kvflow.runtime.disagg.ranks import Endpoint, registration, tp_size_of, tp_size_problem

__all__ = ["ROOM_STATES", "BootstrapClient", "BootstrapError", "RoomReport"]

# every state of a room a prefill may report (see rooms.py); "unknown": it has no such room
ROOM_STATES = frozenset(
    {"waiting", "queued", "ready", "transferring", "done", "failed", "cancelled", "unknown"}
)
_MESSAGE_CHARS = 500  # a peer's message reaches the decode's client: keep it short


class BootstrapError(RuntimeError):
    """The prefill refused (``refused``), could not be reached, or answered nonsense."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class RoomReport(NamedTuple):
    """One room's state as its prefill reports it; ``result`` (the prefill's result, parsed
    by the decode with ``PrefillResult.from_json``) comes with ``done``, ``message`` says
    why a room failed."""

    state: str
    result: dict[str, Any]
    message: str

    @classmethod
    def parse(cls, raw: Any) -> RoomReport:
        """A peer's report; one that is not a report is a failed room saying so."""
        if not isinstance(raw, dict) or raw.get("state") not in ROOM_STATES:
            return cls("failed", {}, "the prefill sent a malformed room report")
        result, message = raw.get("result") or {}, raw.get("message") or ""
        if not isinstance(result, dict) or not isinstance(message, str):
            return cls("failed", {}, "the prefill sent a malformed room report")
        return cls(raw["state"], result, message[:_MESSAGE_CHARS])


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes, every read bounded by one deadline for the whole answer: a peer
    that sends a byte now and then cannot hold a call past it."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the prefill's bootstrap answer took too long")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _DeadlineSocket:
    """What ``http.client.HTTPResponse`` reads an answer from."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


def _room_keys(raw: Any, what: str) -> dict[int, Any]:
    """``{"<room>": value}`` with rooms as integers; BootstrapError if it is not that."""
    if not isinstance(raw, dict):
        raise BootstrapError(f"the prefill's {what} is not an object")
    try:
        return {int(room): value for room, value in raw.items()}
    except ValueError as err:
        raise BootstrapError(f"the prefill's {what} names a room that is not a number") from err


class BootstrapClient:
    """The decode's calls to one prefill's bootstrap endpoint (blocking, each within
    ``timeout_s``); ``key`` is sent as ``Authorization: Bearer``."""

    def __init__(self, address: str, timeout_s: float = 2.0, key: str | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json"}
        if key is not None:
            self._headers["Authorization"] = f"Bearer {key}"

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            status, data = self._exchange(path, json.dumps(body).encode())
        except (OSError, http.client.HTTPException) as err:
            # HTTPException: a prefill killed mid-answer (IncompleteRead, BadStatusLine);
            # anything escaping here would end the watcher of this prefill's rooms
            raise BootstrapError(f"prefill bootstrap at {self.address} unreachable: {err}") from err
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        if status >= 400:
            message = answer.get("error") if isinstance(answer, dict) else None
            if not isinstance(message, str):
                message = f"HTTP {status}"
            message = f"prefill bootstrap at {self.address}: {message[:_MESSAGE_CHARS]}"
            raise BootstrapError(message, refused=400 <= status < 500)
        if not isinstance(answer, dict):
            raise BootstrapError(f"prefill bootstrap at {self.address} answered no JSON object")
        return answer

    def _exchange(self, path: str, data: bytes) -> tuple[int, bytes]:
        deadline = time.monotonic() + self.timeout_s
        conn = http.client.HTTPConnection(self.address, timeout=self.timeout_s)
        try:
            conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            conn.request("POST", path, body=data, headers=self._headers)
            response = http.client.HTTPResponse(
                _DeadlineSocket(conn.sock, deadline),  # type: ignore[arg-type]
                method="POST",
            )
            response.begin()
            answer = response.read(MAX_BODY_BYTES + 1)
            if len(answer) > MAX_BODY_BYTES:
                raise BootstrapError(f"prefill bootstrap at {self.address} answered too much")
            return response.status, answer
        finally:
            conn.close()

    def register(
        self,
        session: str,
        layout: KVLayout,
        peer: dict[str, Any] | None = None,
        tp_ranks: Sequence[Endpoint] = (),
    ) -> None:
        """Register this decode's ``layout`` and its transport's ``peer`` info (under tensor
        parallelism rank 0's, with the other ranks' endpoints in ``tp_ranks``); the prefill
        refuses a layout that differs from its own, another tensor-parallel size (or a peer
        its transport cannot reach), and so does the decode with the layout and size the
        prefill answers (a refusal, e.g. another ``--kv-cache-dtype``: the KV bytes would not
        mean the same)."""
        answer = self._post("/register", registration([Endpoint(session, layout, peer), *tp_ranks]))
        try:
            theirs = KVLayout.from_dict(answer.get("layout"))  # type: ignore[arg-type]
            tp_size = tp_size_of(answer)
        except (ValueError, TypeError, AttributeError) as err:
            raise BootstrapError(
                f"prefill bootstrap at {self.address} answered no KV layout: {err}"
            ) from err
        problem = tp_size_problem(tp_size, 1 + len(tp_ranks)) or layout.mismatch(theirs)
        if problem:
            raise BootstrapError(
                f"refused the prefill at {self.address}: {problem}"[:_MESSAGE_CHARS], refused=True
            )

    def claim(self, session: str, claims: list[tuple[int, list[int], str]]) -> dict[int, str]:
        """Claim rooms ``(room, slots, prompt_hash)``; returns the refused ones with the
        reason."""
        body = {
            "session": session,
            "claims": [{"room": r, "slots": s, "prompt_hash": h} for r, s, h in claims],
        }
        refused = _room_keys(self._post("/rooms", body).get("refused"), "refusals")
        return {
            room: why[:_MESSAGE_CHARS] if isinstance(why, str) else "refused by the prefill"
            for room, why in refused.items()
        }

    def status(
        self, rooms: list[int], cancel: list[int], wait_ms: int = 0
    ) -> dict[int, RoomReport]:
        """The reports of ``rooms`` the prefill gave (rooms it was not asked about are left
        out), after cancelling ``cancel``; with ``wait_ms`` (keep it well under
        ``timeout_s``), once one of them ended, or after that long (a prefill that does not
        wait answers at once)."""
        body: dict[str, Any] = {"rooms": rooms, "cancel": cancel}
        if wait_ms > 0:
            body["wait_ms"] = wait_ms
        states = self._post("/rooms/status", body).get("states")
        asked = set(rooms)
        return {
            room: RoomReport.parse(raw)
            for room, raw in _room_keys(states, "room states").items()
            if room in asked
        }
