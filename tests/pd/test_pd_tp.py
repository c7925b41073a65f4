"""Prefill/decode with tensor parallelism (gloo on CPU): a prefill and a decode at
``--tp-size 2`` (a random-weight Llama with 2 KV heads: one per rank, so each rank's KV is
its own half) through ``kvflow router`` equal a unified server at ``--tp-size 1`` token for
token; a decode of another size is refused when it registers and its request ends with
that error; a KV write that fails on one rank fails the room on every rank, and both sides
end idle with their KV free (own stack: processes get stopped)."""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import httpx
import psutil
import pytest
from pd_flags import COMMON, trusting
from router_process import RouterProcess
from server_process import ServerProcess, free_port

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from tiny_llama import save_tiny_llama

pytestmark = pytest.mark.slow

MAX_NEW = 16
# 1 chunk, 2 chunks, 11 chunks of the prefill's 64 (COMMON's --chunked-prefill-size)
PROMPT_LENS = (5, 100, 700)


class TPStack(NamedTuple):
    prefill: ServerProcess  # --tp-size 2
    bootstrap_port: int
    decode: ServerProcess  # --tp-size 2
    decode_tp1: ServerProcess  # --tp-size 1, trusting the same prefill
    unified: ServerProcess  # --tp-size 1
    router: RouterProcess  # prefill -> decode (both at 2)


@pytest.fixture(scope="module")
def stack(model_path, tmp_path_factory) -> Iterator[TPStack]:
    logs = tmp_path_factory.mktemp("pd-tp")
    save_tiny_llama(logs / "tiny")
    model = ("--model-path", str(logs / "tiny"), "--tokenizer-path", str(model_path), *COMMON)
    port = free_port()
    tp2 = ("--tp-size", "2")
    specs = {
        "prefill": ("--role", "prefill", "--bootstrap-port", str(port), *tp2, *model),
        "decode": ("--role", "decode", *trusting(port), *tp2, *model),
        "decode_tp1": ("--role", "decode", *trusting(port), *model),
        "unified": model,
    }
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {
            name: pool.submit(ServerProcess, *flags, log=logs / f"{name}.log")
            for name, flags in specs.items()
        }
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    router = None
    try:
        failed = [f.exception() for f in futures.values() if f.exception() is not None]
        if failed:
            raise failed[0]  # type: ignore[misc]
        router = RouterProcess(
            "--prefill-urls",
            f"{started['prefill'].url}#{port}",
            "--decode-urls",
            started["decode"].url,
            log=logs / "router.log",
        )
        yield TPStack(
            started["prefill"],
            port,
            started["decode"],
            started["decode_tp1"],
            started["unified"],
            router,
        )
    finally:
        if router is not None:
            router.stop()
        for proc in started.values():
            proc.stop()


def _idle(*servers: ServerProcess) -> None:
    for server in servers:
        server.wait_idle_and_free(timeout=30)


def _generate(url: str, ids: list[int]) -> httpx.Response:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
    }
    return httpx.post(f"{url}/generate", json=body, timeout=180)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in PROMPT_LENS]


def test_pd_at_tp2_equals_unified_at_tp1(stack):
    """One by one, then all at once (one prefill batch, one decode batch), then again (the
    prefill's radix cache holds them: its prefix hits go out as the prompt's first KV)."""
    assert stack.prefill.server_info()["tp_size"] == 2
    assert stack.decode.server_info()["tp_size"] == 2
    prompts = _prompts(seed=3)
    want = [_generate(stack.unified.url, ids).json()["output_ids"] for ids in prompts]
    for ids, expected in zip(prompts, want, strict=True):
        response = _generate(stack.router.url, ids)
        assert response.status_code == 200, response.text
        assert response.json()["output_ids"] == expected, len(ids)

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=180) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"{stack.router.url}/generate",
                        json={
                            "input_ids": ids,
                            "sampling_params": {
                                "max_new_tokens": MAX_NEW,
                                "temperature": 0,
                                "ignore_eos": True,
                            },
                        },
                    )
                    for ids in prompts
                )
            )

    for _ in range(2):
        replies = asyncio.run(together())
        assert [r.status_code for r in replies] == [200] * len(prompts)
        assert [r.json()["output_ids"] for r in replies] == want
    assert replies[-1].json()["meta_info"]["cached_tokens"] >= 640  # the prefill's radix hits
    _idle(stack.prefill, stack.decode)


def test_chat_through_pd_at_tp2_equals_unified(stack):
    body = {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": MAX_NEW,
    }
    want = httpx.post(f"{stack.unified.url}/v1/chat/completions", json=body, timeout=120)
    got = httpx.post(f"{stack.router.url}/v1/chat/completions", json=body, timeout=120)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
    _idle(stack.prefill, stack.decode)


def test_a_decode_of_another_tp_size_is_refused(stack):
    """The TP=1 decode registers with the TP=2 prefill: refused, naming both sizes; its
    request ends at once with that error (a 503), and the prefill's parked KV is freed
    when its room times out."""
    bootstrap = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": stack.bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }
    body = {
        "input_ids": _prompts(seed=4)[1],
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
        **bootstrap,
    }
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        prefilled = pool.submit(httpx.post, f"{stack.prefill.url}/generate", json=body, timeout=60)
        decoded = pool.submit(httpx.post, f"{stack.decode_tp1.url}/generate", json=body, timeout=60)
        response = decoded.result()
        assert prefilled.result().status_code == 200  # the first token: the prefill's half
    assert time.monotonic() - start < 10
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert "tensor-parallel size differs (prefill --tp-size 2, decode --tp-size 1)" in message
    _idle(stack.prefill, stack.decode_tp1)


def _rank1(server: ServerProcess) -> psutil.Process:
    """Scheduler rank 1 of a server (spawned after rank 0, before the detokenizer)."""
    spawned = [
        child
        for child in psutil.Process(server.proc.pid).children()
        if "spawn_main" in " ".join(child.cmdline())
    ]
    return sorted(spawned, key=lambda child: child.create_time())[1]


def _metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(
        float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name)
    )


def _wait_for(check, what: str, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.05)


def test_a_write_failing_on_one_rank_fails_the_room_on_every_rank(stack):
    """Decode rank 1 frozen (SIGSTOP) while the prefill writes: prefill rank 1's write
    times out, rank 0's lands; the room fails for both (none reports it done), the request
    ends with rank 1's error, and both sides free the request's KV on every rank."""
    failed = "sglang:num_transfer_failed_reqs_total"
    before = _metric(stack.prefill, failed)
    prefill_rank1, decode_rank1 = _rank1(stack.prefill), _rank1(stack.decode)
    ids = _prompts(seed=5)[1]
    replies: list[httpx.Response] = []
    # prefill rank 1 held first: the decode claims the room, then the prefill may write
    prefill_rank1.suspend()
    try:
        asking = threading.Thread(target=lambda: replies.append(_generate(stack.router.url, ids)))
        asking.start()
        _wait_for(
            lambda: _metric(stack.decode, "sglang:num_decode_transfer_queue_reqs") >= 1,
            "the decode's claim",
        )
        decode_rank1.suspend()
        prefill_rank1.resume()
        _wait_for(lambda: _metric(stack.prefill, failed) > before, "the failed write")
    finally:
        prefill_rank1.resume()
        decode_rank1.resume()
    asking.join(60)
    assert len(replies) == 1 and replies[0].status_code == 503, replies and replies[0].text
    message = replies[0].json()["error"]["message"]
    assert "KV transfer failed" in message and "(tensor-parallel rank 1)" in message
    _idle(stack.prefill, stack.decode)
    want = _generate(stack.unified.url, ids).json()["output_ids"]
    assert _generate(stack.router.url, ids).json()["output_ids"] == want  # the pair serves on
    _idle(stack.prefill, stack.decode)
