"""Process lifecycle: SIGTERM drains in-flight requests; a dead subprocess makes the server
unhealthy and exit non-zero instead of hanging."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil
from server_process import ServerProcess

# Long enough that it is still decoding when SIGTERM comes, however fast the machine: the
# signal is sent once its first tokens have streamed back.
LONG_TOKENS = 256
LONG = {
    "text": "Once upon a time",
    "stream": True,
    "sampling_params": {"max_new_tokens": LONG_TOKENS, "ignore_eos": True},
}


def test_sigterm_drains_in_flight_and_refuses_new(embedded_ready, tmp_path):
    server = ServerProcess("--drain-timeout", "240", log=tmp_path / "server.log")
    try:
        result: dict = {}
        streaming = threading.Event()

        def in_flight() -> None:
            with httpx.stream("POST", f"{server.url}/generate", json=LONG, timeout=300) as resp:
                result["status"] = resp.status_code
                events = []
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        events.append(line.removeprefix("data:").strip())
                        streaming.set()
                result["events"] = events

        worker = threading.Thread(target=in_flight)
        worker.start()
        assert streaming.wait(120), "the in-flight request never started streaming"
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        late = httpx.post(f"{server.url}/generate", json=LONG, timeout=30)
        assert late.status_code == 503 and "shutting down" in late.text
        worker.join(300)
        assert result["status"] == 200 and result["events"][-1] == "[DONE]"
        last = json.loads(result["events"][-2])
        assert last["meta_info"]["completion_tokens"] == LONG_TOKENS
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


def test_kill_9_of_the_server_leaves_no_orphans(embedded_ready, tmp_path):
    server = ServerProcess(log=tmp_path / "server.log")
    children = psutil.Process(server.proc.pid).children()
    assert len(children) >= 2  # scheduler + detokenizer
    server.proc.kill()
    server.proc.wait(30)
    _, alive = psutil.wait_procs(children, timeout=20)
    for child in alive:
        child.kill()
    assert not alive, f"children outlived the server: {[c.pid for c in alive]}"
