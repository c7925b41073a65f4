"""Queue limits, aborts, client disconnects and the API key, on a server with tight limits."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from server_process import ServerProcess

KEY = "s3cret"
LONG = {
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 60,
    "ignore_eos": True,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def tight(embedded_ready, tmp_path_factory):
    proc = ServerProcess(
        "--max-running-requests",
        "2",
        "--max-queued-requests",
        "1",
        "--api-key",
        KEY,
        "--max-total-tokens",
        "4000",
        log=tmp_path_factory.mktemp("tight") / "server.log",
    )
    yield proc
    proc.stop()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_api_key_required_except_on_open_paths(tight):
    assert httpx.get(f"{tight.url}/v1/models").status_code == 401
    assert (
        httpx.get(f"{tight.url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code
        == 401
    )
    assert httpx.get(f"{tight.url}/v1/models", headers=auth()).status_code == 200
    assert httpx.get(f"{tight.url}/health").status_code == 200
    assert httpx.get(f"{tight.url}/metrics").status_code == 200


def test_over_the_queue_limit_gets_503_at_once(tight):
    async def burst() -> list[tuple[int, float]]:
        async with httpx.AsyncClient(base_url=tight.url, headers=auth(), timeout=300) as client:

            async def one() -> tuple[int, float]:
                start = time.monotonic()
                response = await client.post("/v1/chat/completions", json=LONG)
                if response.status_code == 503:
                    assert response.headers["retry-after"] == "1"
                    assert "queue limit" in response.json()["error"]["message"]
                return response.status_code, time.monotonic() - start

            return await asyncio.gather(*(one() for _ in range(8)))

    results = asyncio.run(burst())
    codes = [code for code, _ in results]
    assert codes.count(200) >= 3 and codes.count(503) >= 1, codes
    slowest_ok = max(t for code, t in results if code == 200)
    assert all(t < slowest_ok for code, t in results if code == 503), "503s must come at once"
    tight.wait_idle_and_free(KEY)


def test_requests_one_after_another_are_never_refused(tight):
    for _ in range(6):
        response = httpx.post(
            f"{tight.url}/v1/chat/completions",
            headers=auth(),
            timeout=120,
            json={**LONG, "max_tokens": 4},
        )
        assert response.status_code == 200


def test_client_disconnect_mid_stream_aborts_and_frees(tight):
    before = _aborted(tight)
    with httpx.stream(
        "POST",
        f"{tight.url}/v1/chat/completions",
        headers=auth(),
        timeout=120,
        json={**LONG, "max_tokens": 500, "stream": True},
    ) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert any("content" in line for line in received)
    info = tight.wait_idle_and_free(KEY)
    assert info["stats"]["kv_request_tokens"] == 0
    assert _aborted(tight) == before + 1
    assert (
        httpx.post(
            f"{tight.url}/v1/chat/completions",
            headers=auth(),
            json={**LONG, "max_tokens": 2},
            timeout=60,
        ).status_code
        == 200
    )


def test_abort_request_endpoint(tight):
    async def run() -> tuple[dict, httpx.Response]:
        async with httpx.AsyncClient(base_url=tight.url, headers=auth(), timeout=300) as client:
            body = {
                "text": "Once upon a time",
                "rid": "story-1",
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
            }
            task = asyncio.create_task(client.post("/generate", json=body))
            for _ in range(300):
                await asyncio.sleep(0.1)
                if (await client.get("/get_server_info")).json()["stats"]["num_running_reqs"]:
                    break
            aborted = (await client.post("/abort_request", json={"rid": "story-1"})).json()
            return aborted, await task

    aborted, result = asyncio.run(run())
    assert aborted == {"rid": "story-1", "found": True}
    assert result.status_code == 499  # the client's own abort: never a 200 with partial text
    assert "aborted by /abort_request" in result.json()["error"]["message"]
    tight.wait_idle_and_free(KEY)


def _aborted(server: ServerProcess) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("sglang:num_aborted_requests_total"):
            return float(line.split()[-1])
    return 0.0
