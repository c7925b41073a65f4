"""The bootstrap endpoint of a prefill instance (``--bootstrap-port``).

Routes (JSON over HTTP; the decode's scheduler process is the only client, see
:mod:`kvflow.runtime.disagg.bootstrap_client`)::

    POST /register       {"session", "layout", "peer"}    -> 200 {"layout"} | 409 {"error"}
                                                          (layout or tp_size mismatch, or a peer
                                                          the transport cannot reach)
    POST /rooms          {"session", "claims": [{"room", "slots", "prompt_hash"}]}
                                                          -> {"refused": {room: why}}
    POST /rooms/status   {"rooms": [...], "cancel": [...], "wait_ms"?}
                                                          -> {"states": {room: {"state", ...}}}

With a key (the deployment's internal credential, ``$KVFLOW_INTERNAL_KEY``) every route
needs ``Authorization: Bearer <key>``; 401 otherwise. A body that is not what a route
takes is a 400, one over :data:`MAX_BODY_BYTES` a 413.

A decode registers its transport session, KV layout and transport peer info (``peer``: what
its transport tells writers, ``{"transport": "mooncake"}`` when absent) once, claims rooms as requests
arrive, and polls their states in batches (see :mod:`kvflow.runtime.disagg.rooms`); a poll
with ``wait_ms`` (at most :data:`MAX_WAIT_MS`; absent: 0, as before) is answered once one of
its rooms ends or a room arrives unclaimed, or after that long. Under
tensor parallelism the registration names every rank's endpoint (``tp_size``, ``ranks``:
:mod:`kvflow.runtime.disagg.ranks`); this endpoint runs on the prefill's rank 0 and checks
each against its own rank's layout.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvflow.runtime.disagg.layout import KVLayout
from kvflow.runtime.disagg.ranks import Endpoint, parse_registration, tp_size_problem
from kvflow.runtime.disagg.rooms import Claim, Rooms
from kvflow.runtime.disagg.transport.base import TransferError

__all__ = ["MAX_BODY_BYTES", "MAX_WAIT_MS", "BootstrapServer"]
logger = logging.getLogger("kvflow.bootstrap")

MAX_BODY_BYTES = 64 << 20  # a request or an answer; a claim of a 128k-token prompt is ~1 MB
MAX_WAIT_MS = 1000  # a status call's longest wait (well inside a client's call timeout)
_ROOM_LIMIT = 1 << 64  # SGLang's rooms are unsigned 64-bit
_HEX = re.compile(r"[0-9a-f]{1,128}")


def _ints(value: Any, name: str, limit: int) -> list[int]:
    """A JSON list of integers in ``[0, limit)`` (ValueError names the field otherwise)."""
    if not isinstance(value, list) or not all(
        type(v) is int and 0 <= v < limit
        for v in value  # bool is not a room or a slot
    ):
        raise ValueError(f"{name} must be a list of integers in [0, {limit})")
    return value


def _claim(session: str, item: Any) -> tuple[int, Claim]:
    if not isinstance(item, dict):
        raise ValueError("a claim must be an object")
    (room,) = _ints([item.get("room")], "room", _ROOM_LIMIT)
    digest = item.get("prompt_hash")
    if not isinstance(digest, str) or not _HEX.fullmatch(digest):
        raise ValueError("a claim needs its prompt's prompt_hash (the decode is too old?)")
    slots = tuple(_ints(item.get("slots"), "slots", 1 << 62))
    return room, Claim(session, slots, digest)


class BootstrapServer:
    """Serves the bootstrap routes on ``host:port`` from daemon threads. ``layout`` is this
    prefill's KV pool; under tensor parallelism ``rank_layouts`` holds every rank's, rank 0's
    (``layout``) first."""

    def __init__(
        self,
        host: str,
        port: int,
        layout: KVLayout,
        rooms: Rooms,
        key: str | None = None,
        on_register: Callable[[str, dict[str, Any]], None] | None = None,
        on_claim: Callable[[], None] | None = None,
        rank_layouts: Sequence[KVLayout] = (),
    ) -> None:
        self.layout = layout
        self.on_claim = on_claim  # a room was claimed: the prefill may send its KV now
        self.layouts = tuple(rank_layouts) or (layout,)
        self.on_register = on_register  # the transport's check of a decode's peer info
        self.rooms = rooms
        # registered decodes: session (its rank 0's) -> every rank's endpoint, rank 0 first
        self.sessions: dict[str, tuple[Endpoint, ...]] = {}
        self._expected = None if key is None else f"Bearer {key}".encode()
        server = self

        class Handler(BaseHTTPRequestHandler):
            # the answer's headers and body are two writes: without this the body waits
            # for the decode's ACK of the headers (Nagle), milliseconds on every poll
            disable_nagle_algorithm = True

            def log_message(self, fmt: str, *args: Any) -> None:  # quiet: one line per poll
                logger.debug(fmt, *args)

            def do_POST(self) -> None:
                status, answer = server.serve(self)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="kvflow-bootstrap", daemon=True
        )

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries the key (constant time); any header
        passes when no key is set."""
        if self._expected is None:
            return True
        return header is not None and hmac.compare_digest(header.encode(), self._expected)

    def serve(self, request: BaseHTTPRequestHandler) -> tuple[int, dict[str, Any]]:
        """Check the credential and the size, then :meth:`handle` the body. A request
        refused before its body was read closes its connection (the body is left unread)."""
        if not self.authorized(request.headers.get("Authorization")):
            request.close_connection = True
            return 401, {
                "error": "the prefill's bootstrap routes need this deployment's internal "
                "key (Authorization: Bearer $KVFLOW_INTERNAL_KEY)"
            }
        try:
            length = int(request.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            request.close_connection = True
            return 413, {"error": f"a bootstrap body must be 0 to {MAX_BODY_BYTES} bytes"}
        try:
            body = json.loads(request.rfile.read(length))
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            return self.handle(request.path, body)
        except (ValueError, KeyError, TypeError) as err:
            return 400, {"error": f"bad bootstrap request: {err}"}

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if path == "/register":
            ranks = parse_registration(body)
            session = ranks[0].session
            problem = self._mismatch(ranks)
            if problem:
                logger.error("refused decode %s: %s", session, problem)
                return 409, {"error": f"refused by the prefill: {problem}"}
            if self.on_register is not None:  # rank 0's transport; the others check theirs
                try:
                    self.on_register(session, ranks[0].peer or {})
                except TransferError as err:
                    logger.error("refused decode %s: %s", session, err)
                    return 409, {"error": f"refused by the prefill: {err}"}
            self.sessions[session] = ranks
            answer = {"layout": self.layout.to_dict()}
            return 200, answer if len(self.layouts) == 1 else {**answer, "tp_size": len(ranks)}
        if path == "/rooms":
            session = str(body["session"])
            if session not in self.sessions:
                return 409, {"error": f"decode session {session} is not registered"}
            if not isinstance(body["claims"], list):
                raise ValueError("claims must be a list")
            refused = {}
            for room, claim in [_claim(session, item) for item in body["claims"]]:
                problem = self.rooms.claim(room, claim)
                if problem:
                    refused[str(room)] = problem
            if self.on_claim is not None and len(refused) < len(body["claims"]):
                self.on_claim()
            return 200, {"refused": refused}
        if path == "/rooms/status":
            rooms = _ints(body.get("rooms", []), "rooms", _ROOM_LIMIT)
            cancel = _ints(body.get("cancel", []), "cancel", _ROOM_LIMIT)
            (wait_ms,) = _ints([body.get("wait_ms", 0)], "wait_ms", MAX_WAIT_MS + 1)
            states = self.rooms.status(rooms, cancel, wait_ms / 1e3)
            return 200, {"states": {str(k): v for k, v in states.items()}}
        return 404, {"error": f"no bootstrap route {path}"}

    def _mismatch(self, ranks: tuple[Endpoint, ...]) -> str | None:
        """Why a decode's ranks cannot receive this prefill's KV, rank by rank; None if
        they can."""
        problem = tp_size_problem(len(self.layouts), len(ranks))
        if problem:
            return problem
        for rank, (mine, theirs) in enumerate(zip(self.layouts, ranks, strict=True)):
            problem = mine.mismatch(theirs.layout)
            if problem:
                return problem if len(ranks) == 1 else f"tensor-parallel rank {rank}: {problem}"
        return None
