"""The bootstrap endpoint of a prefill instance (``--bootstrap-port``) and its client.

Routes (JSON over HTTP; the decode's scheduler process is the only client)::

    POST /register       {"session", "layout"}            -> 200 | 409 {"error"} (layout mismatch)
    POST /rooms          {"session", "claims": [{"room", "slots"}]} -> {"refused": {room: why}}
    POST /rooms/status   {"rooms": [...], "cancel": [...]} -> {"states": {room: {"state", ...}}}

A decode registers its transport session and KV layout once, claims rooms as requests
arrive, and polls their states in batches (see :mod:`kvflow.runtime.disagg.rooms`).
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvflow.runtime.disagg.layout import KVLayout
from kvflow.runtime.disagg.rooms import Claim, Rooms

__all__ = ["BootstrapClient", "BootstrapError", "BootstrapServer"]
logger = logging.getLogger("kvflow.bootstrap")


class BootstrapError(RuntimeError):
    """The prefill refused (``refused``) or could not be reached."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class BootstrapServer:
    """Serves the bootstrap routes on ``host:port`` from daemon threads."""

    def __init__(self, host: str, port: int, layout: KVLayout, rooms: Rooms) -> None:
        self.layout = layout
        self.rooms = rooms
        self.sessions: dict[str, KVLayout] = {}  # registered decodes
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:  # quiet: one line per poll
                logger.debug(fmt, *args)

            def do_POST(self) -> None:
                try:
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"] or 0)))
                    status, answer = server.handle(self.path, body)
                except (ValueError, KeyError, TypeError) as err:
                    status, answer = 400, {"error": f"bad bootstrap request: {err}"}
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

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if path == "/register":
            peer = KVLayout.from_dict(body["layout"])
            problem = self.layout.mismatch(peer)
            if problem:
                logger.error("refused decode %s: %s", body["session"], problem)
                return 409, {"error": f"refused by the prefill: {problem}"}
            self.sessions[str(body["session"])] = peer
            return 200, {"layout": self.layout.to_dict()}
        if path == "/rooms":
            session = str(body["session"])
            if session not in self.sessions:
                return 409, {"error": f"decode session {session} is not registered"}
            refused = {}
            for item in body["claims"]:
                claim = Claim(session, tuple(int(s) for s in item["slots"]))
                problem = self.rooms.claim(int(item["room"]), claim)
                if problem:
                    refused[str(item["room"])] = problem
            return 200, {"refused": refused}
        if path == "/rooms/status":
            rooms = [int(r) for r in body.get("rooms", [])]
            cancel = [int(r) for r in body.get("cancel", [])]
            states = self.rooms.status(rooms, cancel)
            return 200, {"states": {str(k): v for k, v in states.items()}}
        return 404, {"error": f"no bootstrap route {path}"}


class BootstrapClient:
    """The decode's calls to one prefill's bootstrap endpoint (blocking, with a timeout)."""

    def __init__(self, address: str, timeout_s: float = 2.0) -> None:
        self.base = f"http://{address}"
        self.timeout_s = timeout_s

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read()).get("error", str(err))
            except (ValueError, OSError, http.client.HTTPException):
                message = str(err)
            raise BootstrapError(message, refused=400 <= err.code < 500) from err
        except (OSError, ValueError, http.client.HTTPException) as err:
            # HTTPException: a prefill killed mid-answer (IncompleteRead, BadStatusLine);
            # anything escaping here would end the decode's watcher thread, and with it
            # every room it watches
            raise BootstrapError(f"prefill bootstrap at {self.base} unreachable: {err}") from err

    def register(self, session: str, layout: KVLayout) -> None:
        self._post("/register", {"session": session, "layout": layout.to_dict()})

    def claim(self, session: str, claims: list[tuple[int, list[int]]]) -> dict[int, str]:
        """Claim rooms; returns the refused ones with the reason."""
        body = {"session": session, "claims": [{"room": r, "slots": s} for r, s in claims]}
        refused = self._post("/rooms", body)["refused"]
        return {int(room): why for room, why in refused.items()}

    def status(self, rooms: list[int], cancel: list[int]) -> dict[int, dict[str, Any]]:
        states = self._post("/rooms/status", {"rooms": rooms, "cancel": cancel})["states"]
        return {int(room): state for room, state in states.items()}
