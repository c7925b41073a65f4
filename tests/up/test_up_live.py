"""``kvflow up`` with the examples, for real: the printed curl line answers through the
router, a killed worker is reported and restarted, Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from up_process import UpProcess, alive, descendants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 420  # two or more model loads on 2 shared cores


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ask(curl: str, patience_s: float = 180) -> dict:
    """Run the printed curl line (greedy, so the answer can be compared).

    A 503 (the router found no healthy worker: on this shared 2-core machine a load spike
    times out its 2 s health checks) is asked again until ``patience_s`` has passed.
    """
    argv = shlex.split(curl)
    body = json.loads(argv[-1])
    body["temperature"] = 0
    argv[-1] = json.dumps(body)
    deadline = time.monotonic() + patience_s
    while True:
        done = subprocess.run([*argv, "-s", "--max-time", "300"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        if answer.get("error", {}).get("code") != 503 or time.monotonic() > deadline:
            return answer
        time.sleep(2)


def stop_and_check_nothing_left(up: UpProcess) -> None:
    processes = descendants(up.proc.pid)
    assert processes, "kvflow up started nothing"
    assert up.interrupt() == 0, "\n".join(up.lines[-40:])
    deadline = time.monotonic() + 15  # SIGKILLed stragglers vanish asynchronously
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(processes), f"left behind: {alive(processes)}"
    assert up.lines[-1] == "[kvflow up] stopped"


def test_unified_example_answers_restarts_a_killed_worker_and_stops_clean(tmp_path):
    up = UpProcess(REPO / "examples" / "unified-embedded.yaml", free_port(), tmp_path)
    try:
        curl = up.wait_line(r"\[kvflow up\] try: (curl .*)", READY_TIMEOUT_S).group(1)
        answer = ask(curl)
        assert "choices" in answer, answer
        assert answer["choices"][0]["message"]["content"] == "The capital of France is Paris."
        # kill -9 one worker: reported, restarted, healthy again, and the router still answers.
        port = up.wait_line(r"\[kvflow up\] unified-0: .* --port (\d+)", 5).group(1)
        (worker,) = [
            pid
            for pid in descendants(up.proc.pid)
            if f"--port\0{port}\0" in Path(f"/proc/{pid}/cmdline").read_text()
        ]
        marker = len(up.lines)
        os.kill(worker, signal.SIGKILL)
        up.wait_line(r"unified-0 exited with code -9; restarting \(1/2", 30, marker)
        assert ask(curl)["choices"][0]["message"]["content"]  # the other worker serves
        up.wait_line(r"\[kvflow up\] unified-0 healthy again", READY_TIMEOUT_S, marker)
        stop_and_check_nothing_left(up)
    finally:
        up.kill()


def test_disaggregated_hicache_example_answers_through_prefill_and_decode(tmp_path):
    up = UpProcess(REPO / "examples" / "disaggregated-hicache.yaml", free_port(), tmp_path)
    try:
        curl = up.wait_line(r"\[kvflow up\] try: (curl .*)", READY_TIMEOUT_S).group(1)
        assert "Authorization: Bearer change-me" in curl  # the Secret beside the spec
        answer = ask(curl)
        assert "choices" in answer, answer
        assert answer["choices"][0]["message"]["content"] == "The capital of France is Paris."
        # It went router -> prefill -> decode: the prefill wrote KV to a decode.
        port = up.wait_line(r"\[kvflow up\] prefill-0: .* --port (\d+)", 5).group(1)
        sent = 0.0
        deadline = time.monotonic() + 15  # the prefill publishes its counters every 0.25 s
        while sent <= 0 and time.monotonic() < deadline:
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            found = re.search(
                rb"^kvflow:kv_transfer_bytes_total(?:\{[^}]*\})? (\S+)$", metrics, re.M
            )
            assert found is not None
            sent = float(found.group(1))
            time.sleep(0.25)
        assert sent > 0
        logs = {p.name for p in (tmp_path / "logs").glob("*.log")}
        assert {"mooncake-master.log", "prefill-0.log", "decode-0.log", "decode-1.log"} <= logs
        stop_and_check_nothing_left(up)
    finally:
        up.kill()


def test_a_refused_command_stops_everything_with_the_reason(tmp_path):
    """A worker whose flags ``kvflow serve`` refuses (exit 2) is not restarted: kvflow up
    reports the runtime's own message, stops the rest and exits 1."""
    body = (REPO / "examples" / "unified-embedded.yaml").read_text()
    body = body.replace("  unified:\n", "  unified:\n    extraArgs: [--no-such-flag]\n", 1)
    spec = tmp_path / "md.yaml"
    spec.write_text(body)
    up = UpProcess(spec, free_port(), tmp_path / "state")
    try:
        assert up.proc.wait(240) == 1, "\n".join(up.lines[-40:])
        up.wait_line(r"failed: unified-\d refused its command \(exit 2\)", 5)
        up.wait_line(r"unrecognized arguments: --no-such-flag", 5)
        assert up.lines[-1] == "[kvflow up] stopped"
        # Nothing it started is left: no process carries the refused flag any more.
        left = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if b"--no-such-flag" in (proc / "cmdline").read_bytes():
                    left.append(proc.name)
            except OSError:
                continue
        assert not alive({int(pid) for pid in left}), left
    finally:
        up.kill()
