"""One tensor-parallel group over two "nodes" (two ``kvflow serve`` launchers on loopback,
SGLang's ``--nnodes 2 --node-rank 0|1 --dist-init-addr``): node 0 serves HTTP with rank 0,
node 1 runs rank 1 only; greedy output equals transformers; the end of either node ends the
other's ranks too, in bounded time, leaving no process; settings that cannot run are
refused before anything starts."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_process import ServerProcess, assert_refused_at_start, free_port, processes_left
from tiny_llama import hf_greedy, save_tiny_llama

MAX_NEW = 12


def _node(folder: Path, tokenizer: Path, rank: int, addr: str, log: Path) -> subprocess.Popen:
    """Node 1's launcher (no HTTP server: it is not waited on like a server)."""
    flags = _flags(folder, tokenizer, rank, addr)
    return subprocess.Popen(
        [sys.executable, "-P", "-m", "kvflow", "serve", "--port", "1", *flags],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def _flags(folder: Path, tokenizer: Path, rank: int, addr: str) -> list[str]:
    return [
        "--model-path", str(folder), "--tokenizer-path", str(tokenizer), "--dtype", "float32",
        "--tp-size", "2", "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", addr,
        "--max-total-tokens", "2000",
    ]  # fmt: skip


def _family(pid: int) -> list[int]:
    return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]


@pytest.mark.parametrize("victim", [1, 0])
def test_two_nodes_serve_as_one_and_end_together(tmp_path, model_path, victim):
    folder = tmp_path / "tiny"
    hf = save_tiny_llama(folder)
    addr = f"127.0.0.1:{free_port()}"
    worker = _node(folder, model_path, 1, addr, tmp_path / "node1.log")
    try:
        server = ServerProcess(*_flags(folder, model_path, 0, addr), log=tmp_path / "node0.log")
    except Exception:
        worker.kill()
        raise
    family = _family(server.proc.pid) + _family(worker.pid)
    try:
        prompts = [[5, 6, 7, 8], list(range(100, 141))]
        body = {
            "input_ids": prompts,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW},
        }
        reply = httpx.post(f"{server.url}/generate", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert [r["output_ids"] for r in reply.json()] == [
            hf_greedy(hf, p, MAX_NEW) for p in prompts
        ]
        assert server.server_info()["tp_size"] == 2
        assert worker.poll() is None
        killed = server.proc if victim == 0 else worker
        other = worker if victim == 0 else server.proc
        killed.kill()
        killed_at = time.monotonic()
        try:
            code = other.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {1 - victim} still ran 30 s after node {victim} died")
        assert code != 0
        assert time.monotonic() - killed_at < 10, time.monotonic() - killed_at
        deadline = time.monotonic() + 10
        while processes_left(family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not processes_left(family), processes_left(family)
    finally:
        server.stop()
        worker.kill()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "2", "--tp-size", "2"], "needs --dist-init-addr"),
        (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "--node-rank 2"),
        (["--nnodes", "2", "--tp-size", "3", "--dist-init-addr", "h:1"], "does not split"),
        (["--tp-size", "3", "--dist-init-addr", "nowhere"], "is not HOST:PORT"),
        (
            ["--nnodes", "3", "--tp-size", "3", "--dist-init-addr", "h:1", "--role", "prefill"],
            "prefill/decode over nodes is not built",
        ),
    ],
)
def test_node_settings_refused_before_start(model_path, flags, message):
    assert_refused_at_start(flags, message)
