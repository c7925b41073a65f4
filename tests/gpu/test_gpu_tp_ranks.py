"""Tensor parallelism across several GPUs (NCCL, one GPU per rank, CUDA graphs capturing
the decode step with its all-reduces): greedy output at TP 2, 4 and 8 equals TP 1 on the
same random-weight checkpoint, token for token; a rank killed with SIGKILL while a stream
is in flight ends the server with an error within 5 s and leaves no process.

Each case needs as many GPUs as its TP size and skips on a machine with fewer (missing
hardware); run on a several-GPU machine with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_process import ServerProcess, processes_left
from tp_ranks import run_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason="needs 2 or more GPUs")]

# Heads and KV heads divisible by 8; weights drawn wide enough that logits are peaked, so
# the different summation order of a split matmul (float32) cannot flip an argmax.
CONFIG = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 4096,
    "max_position_embeddings": 65536,
    "eos_token_id": 2,
}
GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
ENGINE = {
    "dtype": "float32",
    "skip_tokenizer_init": True,
    "max_running_requests": 16,
    "cuda_graph_max_bs": 16,
    "chunked_prefill_size": 64,
    "max_total_tokens": 8192,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tp-llama")
    hf = LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=False))
    for param in hf.parameters():
        if param.dim() > 1:
            param.data.normal_(0, 0.05)
    hf.save_pretrained(folder)
    return folder


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (3, 70, 17, 200, 9, 129)]


@pytest.fixture(scope="module")
def tp1_outputs(checkpoint) -> list[list[int]]:
    calls = [{"input_ids": _prompts(), "sampling_params": GREEDY}]
    report = run_ranks(1, str(checkpoint), calls, device="cuda", **ENGINE)[0]
    assert report["memory_free"]
    return report["outputs"][0]


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_equals_tp1(checkpoint, tp1_outputs, tp):
    if tp > GPUS:
        pytest.skip(f"needs {tp} GPUs, {GPUS} present")
    # a second call repeats the prompts: radix hits on every rank
    calls = [{"input_ids": _prompts(), "sampling_params": GREEDY}] * 2
    reports = run_ranks(tp, str(checkpoint), calls, device="cuda", **ENGINE)
    for rank, report in enumerate(reports):
        assert report["outputs"] == [tp1_outputs, tp1_outputs], f"rank {rank}"
        assert report["memory_free"], f"rank {rank}"
    assert reports[0]["kv_heads"] == 8 // tp


def test_killed_rank_mid_stream_ends_the_server(checkpoint, tmp_path):
    tp = 4 if GPUS >= 4 else 2
    log = tmp_path / "server.log"
    started = time.monotonic()
    try:
        _killed_rank_ends_the_server(checkpoint, tp, log)
    finally:
        print(f"server log ({time.monotonic() - started:.1f} s after the start):")
        print(log.read_text()[-3000:] if log.exists() else "(none)")


def _killed_rank_ends_the_server(checkpoint: Path, tp: int, log: Path) -> None:
    proc = ServerProcess(
        "--model-path",
        str(checkpoint),
        "--skip-tokenizer-init",
        "--tp-size",
        str(tp),
        "--dtype",
        "bfloat16",
        "--max-total-tokens",
        "70000",
        "--cuda-graph-max-bs",
        "8",
        log=log,
    )
    family = [proc.proc.pid] + [c.pid for c in psutil.Process(proc.proc.pid).children(True)]
    spawned = [
        c for c in psutil.Process(proc.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())
    ]
    rank1 = sorted(spawned, key=lambda c: c.create_time())[1]
    seen: dict[str, object] = {"chunks": 0, "errors": 0}

    def stream() -> None:
        # long enough that it cannot finish before the kill (~1-2 ms a token on an H100)
        sampling = {"max_new_tokens": 60000, "ignore_eos": True}
        body = {"input_ids": [5, 6, 7], "sampling_params": sampling, "stream": True}
        try:
            with httpx.stream("POST", f"{proc.url}/generate", json=body, timeout=30) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        seen["chunks"] = int(seen["chunks"]) + 1  # type: ignore[call-overload]
                        seen["last"] = line
                        if line.startswith('data: {"error"'):
                            seen["errors"] = int(seen["errors"]) + 1  # type: ignore[call-overload]
                        elif line != "data: [DONE]":
                            seen["last_event"] = line[-300:]  # its meta_info: finish_reason
        except httpx.HTTPError as err:
            seen["error"] = repr(err)
        seen["ended_at"] = time.monotonic()

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    deadline = time.monotonic() + 60
    while int(seen["chunks"]) < 5 and time.monotonic() < deadline:  # type: ignore[call-overload]
        time.sleep(0.05)
    if int(seen["chunks"]) < 5:  # type: ignore[call-overload]
        proc.stop()
        pytest.fail(f"no stream: {seen}")
    killed_at = time.monotonic()
    rank1.send_signal(signal.SIGKILL)
    try:
        code = proc.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.stop()
        pytest.fail(f"the server still ran 5 s after rank 1 died:\n{proc.log.read_text()[-2000:]}")
    assert code != 0
    client.join(10)
    assert "ended_at" in seen and float(seen["ended_at"]) - killed_at < 5  # type: ignore[arg-type]
    # the stream ends with an error event (then [DONE], as OpenAI's streams end), not as if
    # its tokens were all there
    assert seen["errors"] == 1, f"a killed stream must end with an error event: {seen}"
    left = processes_left(family)
    assert not left, f"processes left behind: {left}"
    print(f"tp {tp}: server exited {code} {time.monotonic() - killed_at:.2f} s after the kill")
