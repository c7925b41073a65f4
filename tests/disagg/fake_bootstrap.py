"""TEST DOUBLE THAT LIES: a prefill's bootstrap endpoint that answers what a test scripts.

It speaks the bootstrap routes (``/register``, ``/rooms``, ``/rooms/status``) but holds no
model, no KV and no rooms: it says ``done`` without writing a byte, reports first tokens
outside the vocabulary, never answers, drips its answer a byte at a time, or answers
nonsense, as the script says. Used by the unit tests of the decode's client and watcher
and by ``tests/pd/test_pd_trust_datapath.py`` against a real decode server.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

STALL = object()  # accept the request and never answer (until stop())


@dataclass(frozen=True)
class Raw:
    """Bytes written as the whole answer (status line included), ``byte_interval_s``
    apart."""

    data: bytes
    byte_interval_s: float = 0.0


# (path, body) -> (status, JSON answer) | STALL | Raw
Script = Callable[[str, dict[str, Any]], Any]


def reports(report: Any, extra: dict[str, Any] | None = None) -> Script:
    """Registers anyone (answering with the decode's own layout), accepts every claim, and
    reports ``report`` (any shape) for every room it is asked about, plus the ``extra``
    entries."""

    def answer(path: str, body: dict[str, Any]) -> Any:
        if path == "/rooms/status":
            asked = {str(room): report for room in body.get("rooms", [])}
            return 200, {"states": {**asked, **(extra or {})}}
        return 200, {"refused": {}} if path == "/rooms" else {"layout": body.get("layout")}

    return answer


def done_with(result: Any) -> Script:
    """Every room ``done`` with ``result`` at once (nothing was written anywhere)."""
    return reports({"state": "done", "result": result, "message": ""})


def states(raw_states: Any) -> Script:
    """Registers and accepts as :func:`done_with`, then answers ``{"states": raw_states}``
    to every status call (any shape)."""

    def answer(path: str, body: dict[str, Any]) -> Any:
        if path == "/rooms/status":
            return 200, {"states": raw_states}
        return 200, {"refused": {}} if path == "/rooms" else {"layout": body.get("layout")}

    return answer


def stall(path: str, body: dict[str, Any]) -> Any:
    return STALL


class FakeBootstrap:
    """The lying endpoint on 127.0.0.1 (a free port); ``calls`` lists ``(path, body,
    Authorization header)`` of every request it got."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.calls: list[tuple[str, Any, str | None]] = []
        self.released = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                fake.calls.append((self.path, body, self.headers.get("Authorization")))
                answer = fake.script(self.path, body if isinstance(body, dict) else {})
                if answer is STALL:
                    fake.released.wait(120)
                    self.close_connection = True
                    return
                if isinstance(answer, Raw):
                    for i in range(len(answer.data)):
                        if fake.released.is_set():
                            break
                        self.wfile.write(answer.data[i : i + 1])
                        self.wfile.flush()
                        time.sleep(answer.byte_interval_s)
                    self.close_connection = True
                    return
                status, payload = answer
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def paths(self) -> list[str]:
        return [path for path, _, _ in self.calls]

    def stop(self) -> None:
        self.released.set()  # stalled and dripping handlers end
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> FakeBootstrap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
