"""Process lifecycle: SIGTERM drains in-flight requests; a dead subprocess makes the server
unhealthy and exit non-zero instead of hanging."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
from server_process import ServerProcess

LONG = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}


def test_sigterm_drains_in_flight_and_refuses_new(embedded_ready, tmp_path):
    server = ServerProcess("--drain-timeout", "240", log=tmp_path / "server.log")
    try:
        result: dict = {}

        def in_flight() -> None:
            result["response"] = httpx.post(f"{server.url}/generate", json=LONG, timeout=300)

        worker = threading.Thread(target=in_flight)
        worker.start()
        time.sleep(1.5)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        late = httpx.post(f"{server.url}/generate", json=LONG, timeout=30)
        assert late.status_code == 503 and "shutting down" in late.text
        worker.join(300)
        response = result["response"]
        assert response.status_code == 200
        assert response.json()["meta_info"]["completion_tokens"] == 40
        assert server.proc.wait(120) == 0
    finally:
        server.stop()
    assert not [
        c for c in psutil.Process().children(recursive=True) if "kvflow" in " ".join(c.cmdline())
    ]


def test_dead_scheduler_makes_the_server_fail_fast_and_exit(embedded_ready, tmp_path):
    server = ServerProcess(log=tmp_path / "server.log")
    try:
        children = psutil.Process(server.proc.pid).children()
        assert len(children) >= 2  # scheduler + detokenizer (+ multiprocessing's tracker)
        scheduler = max(children, key=lambda c: c.memory_info().rss)  # the one holding the model
        scheduler.kill()
        code = server.proc.wait(60)
        assert code != 0
    finally:
        server.stop()
    assert "exited with code" in (tmp_path / "server.log").read_text()
