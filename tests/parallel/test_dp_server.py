"""``kvflow serve --dp-size 2``: both groups serve (each with its own prefix cache), and an
abort reaches the group that runs its request while the other group's request goes on."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_process import ServerProcess

TIMEOUT_S = 120
GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--dp-size",
        "2",
        "--max-total-tokens",
        "3000",
        "--context-length",
        "2048",
        log=tmp_path_factory.mktemp("dp2") / "server.log",
    )
    yield proc
    proc.stop()


def _generate(server: ServerProcess, text: str) -> dict:
    body = {"text": text, "sampling_params": GREEDY}
    reply = httpx.post(f"{server.url}/generate", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_both_groups_serve_round_robin(server):
    text = "The capital of France is"
    first, second, third = (_generate(server, text) for _ in range(3))
    # each group computes the prompt once; the third request finds group 0's cache
    assert [r["meta_info"]["cached_tokens"] for r in (first, second)] == [0, 0]
    assert third["meta_info"]["cached_tokens"] > 0
    assert first["output_ids"] == second["output_ids"] == third["output_ids"]
    info = server.wait_idle_and_free()
    assert info["engine"]["dp_size"] == 2
    groups = info["dp_stats"]
    assert [g["dp_rank"] for g in groups] == [0, 1]
    assert all(g["generated_tokens"] >= 8 for g in groups)
    assert info["stats"]["kv_total_tokens"] == sum(g["kv_total_tokens"] for g in groups)


def test_abort_reaches_the_right_group(server):
    long = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 0}

    async def run() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as client:
            bodies = [
                {"text": "Once upon a time", "rid": rid, "sampling_params": long}
                for rid in ("dp-a", "dp-b")
            ]
            tasks = [asyncio.create_task(client.post("/generate", json=b)) for b in bodies]
            for _ in range(1200):  # until each group runs one
                groups = (await client.get("/get_server_info")).json()["dp_stats"]
                if all(g["num_running_reqs"] == 1 for g in groups):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"the requests never ran on both groups: {groups}")
            abort = await client.post("/abort_request", json={"rid": "dp-b"})
            return abort, await tasks[0], await tasks[1]

    abort, kept, aborted = asyncio.run(run())
    assert abort.status_code == 200, abort.text
    assert aborted.status_code == 499, aborted.text
    assert kept.status_code == 200, kept.text
    assert kept.json()["meta_info"]["completion_tokens"] == 300
    server.wait_idle_and_free()
