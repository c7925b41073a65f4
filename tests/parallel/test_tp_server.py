"""``kvflow serve --tp-size 2`` through HTTP: the openai client's chat, streaming and n=2,
greedy output equal to transformers; a rank killed with SIGKILL ends the whole server
fast and leaves no process; parallel settings that cannot run are refused before start."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_process import ServerProcess, assert_refused_at_start, processes_left
from tiny_llama import hf_greedy, save_tiny_llama

MAX_NEW = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A random-weight Llama (4 heads, 2 KV heads) over SmolLM2's vocabulary."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, save_tiny_llama(folder)


def _serve(tiny_llama, model_path, log: Path, *flags: str) -> ServerProcess:
    return ServerProcess(
        "--model-path",
        str(tiny_llama[0]),
        "--tokenizer-path",
        str(model_path),
        "--tp-size",
        "2",
        "--max-total-tokens",
        "4000",
        *flags,
        log=log,
    )


@pytest.fixture(scope="module")
def server(tiny_llama, model_path, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = _serve(tiny_llama, model_path, tmp_path_factory.mktemp("tp2") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_generate_equals_transformers(server, tiny_llama, tokenizer):
    prompts = [tokenizer.encode(t) for t in ("Hello", "The sky is blue because", "1 2 3 4")]
    bodies = [
        {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW}}
        for ids in prompts
    ]
    with httpx.Client(timeout=120) as http:
        replies = [http.post(f"{server.url}/generate", json=b).json() for b in bodies]
    assert [r["output_ids"] for r in replies] == [
        hf_greedy(tiny_llama[1], p, MAX_NEW) for p in prompts
    ]
    assert server.server_info()["tp_size"] == 2
    server.wait_idle_and_free()


def test_chat_streaming_and_n2(client, server, tiny_llama, tokenizer):
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text)
    expected = tokenizer.decode(hf_greedy(tiny_llama[1], ids, MAX_NEW), skip_special_tokens=True)
    reply = client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, max_tokens=MAX_NEW
    )
    assert reply.choices[0].message.content == expected
    stream = client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, max_tokens=MAX_NEW, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected
    sampled = dict(model="m", messages=QUESTION, n=2, seed=7, temperature=1.0, max_tokens=8)
    first = client.chat.completions.create(**sampled)
    again = client.chat.completions.create(**sampled)
    assert len(first.choices) == 2 and all(c.finish_reason for c in first.choices)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    server.wait_idle_and_free()


def test_killed_rank_ends_the_server(tiny_llama, model_path, tmp_path):
    proc = _serve(tiny_llama, model_path, tmp_path / "server.log")
    family = [proc.proc.pid] + [c.pid for c in psutil.Process(proc.proc.pid).children(True)]
    # spawned in order: scheduler rank 0, rank 1, then the detokenizer
    spawned = [
        c for c in psutil.Process(proc.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())
    ]
    rank1 = sorted(spawned, key=lambda c: c.create_time())[1]
    events: list[str] = []
    stream = threading.Thread(target=_stream_events, args=(proc.url, events), daemon=True)
    stream.start()
    deadline = time.monotonic() + 30
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(events) >= 3, f"no stream before the kill: {events}"
    killed_at = time.monotonic()
    rank1.send_signal(signal.SIGKILL)
    try:
        code = proc.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.stop()
        pytest.fail(f"the server still ran 5 s after rank 1 died:\n{proc.log.read_text()[-2000:]}")
    assert code != 0
    assert time.monotonic() - killed_at < 5
    assert "scheduler-tp1 was killed by SIGKILL" in proc.log.read_text()
    stream.join(5)
    # the stream in flight ends with an error event (then [DONE]), never as if complete
    assert not stream.is_alive() and events[-2:][0].startswith('data: {"error"'), events[-3:]
    assert sum(e.startswith('data: {"error"') for e in events) == 1
    left = processes_left(family)
    assert not left, f"processes left behind: {left}"


def _stream_events(url: str, events: list[str]) -> None:
    """A long greedy stream of /generate; its SSE data lines, in order, into ``events``."""
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0},
        "stream": True,
    }
    try:
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
    except httpx.HTTPError as err:
        events.append(f"transport error: {err!r}")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp-size", "2"], "--tp-size 2 does not divide this model's 9 attention heads"),
        (["--tp-size", "3", "--device", "cuda"], "needs 3 GPUs"),
        (["--dp-size", "2", "--role", "prefill"], "prefill/decode with data parallelism"),
        (["--dp-size", "0"], "--dp-size must be >= 1"),
    ],
)
def test_refused_before_start(model_path, flags, message):
    """The embedded SmolLM2 (9 heads, 3 KV heads): one line, exit 2, no process started."""
    if "--device" in flags and torch.cuda.device_count() >= 3:
        pytest.skip("this machine has the GPUs")
    assert_refused_at_start(flags, message)
