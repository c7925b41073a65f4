"""Process lifecycle: SIGTERM drains in-flight requests; a dead subprocess makes the server
unhealthy and exit non-zero instead of hanging."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from server_process import ServerProcess, free_port, processes_left

# Long enough that it is still decoding when SIGTERM comes, however fast the machine: the
# signal is sent once its first tokens have streamed back.
LONG_TOKENS = 256
LONG = {
    "text": "Once upon a time",
    "stream": True,
    "sampling_params": {"max_new_tokens": LONG_TOKENS, "ignore_eos": True},
}


def _ipc_folders(tmp: Path) -> list[Path]:
    """The private socket folders (runtime/server/ipc.py) a server made under ``tmp``."""
    return sorted(tmp.glob("kvflow-ipc-*"))


def test_sigterm_drains_in_flight_and_refuses_new(embedded_ready, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = ServerProcess(
        "--drain-timeout", "240", log=tmp_path / "server.log", env={"TMPDIR": str(tmp)}
    )
    assert len(_ipc_folders(tmp)) == 1
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
        tree = [server.proc.pid, *(c.pid for c in psutil.Process(server.proc.pid).children(True))]
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
    # none of the server's processes outlive it (other tests' servers may still run here)
    assert not processes_left(tree)
    assert not _ipc_folders(tmp), "the server's socket folder outlived it"


def test_dead_scheduler_makes_the_server_fail_fast_and_exit(embedded_ready, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = ServerProcess(log=tmp_path / "server.log", env={"TMPDIR": str(tmp)})
    try:
        children = psutil.Process(server.proc.pid).children()
        assert len(children) >= 2  # scheduler + detokenizer (+ multiprocessing's tracker)
        scheduler = max(children, key=lambda c: c.memory_info().rss)  # the one holding the model
        scheduler.kill()
        code = server.proc.wait(60)
        assert code != 0
    finally:
        server.stop()
    assert not _ipc_folders(tmp), "the server's socket folder outlived it"
    log = (tmp_path / "server.log").read_text()
    assert "kvflow-scheduler was killed by SIGKILL (out of memory?)" in log, log[-2000:]
    assert "the server exits" in log


def _spawned_children(proc: psutil.Process) -> list[psutil.Process]:
    """The server's scheduler and detokenizer, in start order (multiprocessing's resource
    tracker, also a child, is left out)."""
    children = []
    for child in proc.children():
        try:  # a short-lived child (a compiler the start-up runs) may be gone already
            if "spawn_main" in " ".join(child.cmdline()):
                children.append((child.create_time(), child))
        except psutil.NoSuchProcess:
            continue
    return [c for _, c in sorted(children, key=lambda pair: pair[0])]


@pytest.mark.parametrize(("index", "name"), [(0, "kvflow-scheduler"), (1, "kvflow-detokenizer")])
def test_child_killed_during_start_up_makes_the_server_exit(embedded_ready, tmp_path, index, name):
    """A child killed while the server waits for it (as the out-of-memory killer does in a
    container over its limit) ends the server within seconds, non-zero, naming the child
    and the signal, leaving no process behind: the kubelet then restarts the container."""
    log = tmp_path / "server.log"
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "kvflow", "serve", "--port", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    server = psutil.Process(proc.pid)
    try:
        deadline = time.monotonic() + 120
        children: list[psutil.Process] = []
        while len(children) < 2 and time.monotonic() < deadline and proc.poll() is None:
            children = _spawned_children(server)
            time.sleep(0.05)
        assert len(children) == 2, log.read_text()[-2000:]
        assert "kvflow: serving" not in log.read_text()  # still starting
        children[index].kill()
        killed_at = time.monotonic()
        code = proc.wait(30)
        exited_after = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 1, text[-2000:]
    assert exited_after < 10, f"exited {exited_after:.1f} s after the kill"
    assert f"{name} was killed by SIGKILL (out of memory?) while starting" in text, text[-2000:]
    assert "Traceback" not in text
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"children outlived the server: {[c.pid for c in alive]}"


def test_dead_detokenizer_after_start_makes_the_server_exit(embedded_ready, tmp_path):
    server = ServerProcess(log=tmp_path / "server.log")
    try:
        (_, detokenizer) = _spawned_children(psutil.Process(server.proc.pid))
        detokenizer.kill()
        killed_at = time.monotonic()
        code = server.proc.wait(30)
        assert time.monotonic() - killed_at < 10
        assert code == 1
    finally:
        server.stop()
    assert "kvflow-detokenizer was killed by SIGKILL" in (tmp_path / "server.log").read_text()


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
