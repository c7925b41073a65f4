"""HiCache through ``kvflow serve`` with the Mooncake store and a real ``mooncake_master``:
greedy answers equal plain serving, a second server's first request hits the first one's
pages in the store, HiCache metrics, the master killed mid-run (requests keep succeeding,
errors are counted), and device and host pools back at their baseline."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import TOPICS, turn

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
sys.path.insert(0, str(Path(__file__).parents[1] / "hicache_storage"))
from l3_helpers import MooncakeMaster, mooncake_installed
from server_process import ServerProcess

pytestmark = pytest.mark.skipif(not mooncake_installed(), reason="mooncake wheel not installed")

# float32: in bfloat16 a prefill over a cached prefix may pick another argmax than one
# over the whole prompt (other matmul shapes, other rounding), and the answers are compared
FLAGS = (
    "--dtype", "float32", "--max-total-tokens", "320", "--page-size", "16", "--context-length", "1024",
    "--hicache-host-memory-gb", "0.03", "--hicache-storage", "mooncake",
    "--hicache-prefetch-timeout", "5",
)  # fmt: skip
PLAIN = (
    "--dtype",
    "float32",
    "--max-total-tokens",
    "2048",
    "--page-size",
    "16",
    "--context-length",
    "1024",
)


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def eventually_positive(server: ServerProcess, name: str, **labels: str) -> float:
    """The metric once above 0 (the scheduler publishes its counters every 0.25 s); 0 if it
    stays there for 10 s."""
    deadline = time.monotonic() + 10
    while (value := metric(server, name, **labels)) <= 0 and time.monotonic() < deadline:
        time.sleep(0.25)
    return value


def generate(server: ServerProcess, prompt: str) -> list[int]:
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    reply = httpx.post(f"{server.url}/generate", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()["output_ids"]


@pytest.fixture(scope="module")
def master(tmp_path_factory) -> Iterator[MooncakeMaster]:
    m = MooncakeMaster(tmp_path_factory.mktemp("master") / "master.log")
    yield m
    m.stop()


def start(master: MooncakeMaster, log: Path) -> ServerProcess:
    config = log.with_suffix(".mooncake.json")
    config.write_text(
        json.dumps(
            {
                "master_server_address": master.address,
                "metadata_server": master.metadata_url,
                "local_hostname": "127.0.0.1",
                "global_segment_size": 64 * 2**20,
                "local_buffer_size": 16 * 2**20,
                "protocol": "tcp",
            }
        )
    )
    os.environ["KVFLOW_MOONCAKE_CONFIG"] = str(config)
    try:
        return ServerProcess(*FLAGS, log=log)
    finally:
        del os.environ["KVFLOW_MOONCAKE_CONFIG"]


@pytest.fixture(scope="module")
def expected(model_path, tmp_path_factory) -> dict[str, list[int]]:
    plain = ServerProcess(*PLAIN, log=tmp_path_factory.mktemp("plain") / "server.log")
    try:
        prompts = [
            turn(t, q) for q in ("Summarize in one line.", "Name one example.") for t in TOPICS
        ]
        return {p: generate(plain, p) for p in prompts}
    finally:
        plain.stop()


def test_two_servers_share_the_mooncake_store_and_survive_its_loss(
    master, expected, tmp_path_factory
):
    first_round = [turn(t, "Summarize in one line.") for t in TOPICS]
    second_round = [turn(t, "Name one example.") for t in TOPICS]
    a = start(master, tmp_path_factory.mktemp("a") / "server.log")
    try:
        for prompt in first_round + second_round:
            assert generate(a, prompt) == expected[prompt]
        host_hits = eventually_positive(a, "kvflow:hicache_hit_tokens_total", tier="host")
        assert host_hits > 0, httpx.get(f"{a.url}/metrics", timeout=30).text
        assert eventually_positive(a, "sglang:backuped_tokens_total") > 0
        assert eventually_positive(a, "kvflow:hicache_storage_bytes_total", op="write") > 0
        a.wait_idle_and_free()

        b = start(master, tmp_path_factory.mktemp("b") / "server.log")
        try:
            assert generate(b, second_round[0]) == expected[second_round[0]]
            assert eventually_positive(b, "sglang:prefetched_tokens_total") > 0
            assert (
                metric(b, "kvflow:hicache_prefetch_total", outcome="full")
                + metric(b, "kvflow:hicache_prefetch_total", outcome="partial")
                > 0
            )
        finally:
            b.stop()

        master.kill()  # the store is gone mid-run: serving goes on with L1/L2
        for prompt in first_round:
            assert generate(a, prompt) == expected[prompt]
        assert eventually_positive(a, "kvflow:hicache_storage_errors_total") > 0
        info = a.wait_idle_and_free()
        assert info["stats"]["hicache"]["host_used_tokens"] > 0
        assert httpx.post(f"{a.url}/flush_cache", timeout=60).status_code == 200
        info = a.server_info()
        assert info["stats"]["hicache"]["host_used_tokens"] == 0
        assert info["stats"]["kv_used_tokens"] == 0
    finally:
        a.stop()
