"""LoRA over HTTP with SGLang's interface: start-up adapters, ``lora_path`` on /generate,
the OpenAI ``model`` field (``base:adapter`` or the adapter's name), /v1/models, and
/load_lora_adapter and /unload_lora_adapter while serving; unknown adapters are 400s."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from lora_adapters import ALL_MODULES, MAX_NEW, build_adapter, build_base, peft_greedy, prompts
from server_process import ServerProcess

from kvflow.contract import LORA_READ_TIMEOUT_ENV

GENERATE = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
READ_TIMEOUT_S = 15  # the server's $KVFLOW_LORA_READ_TIMEOUT_S


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-server")
    base, a, b = root / "base", root / "adapter-a", root / "adapter-b"
    build_base(base)
    build_adapter(base, a, seed=1, r=8, lora_alpha=16, target_modules=ALL_MODULES)
    build_adapter(base, b, seed=2, r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"])
    return {"base": base, "a": a, "b": b}


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--model-path", str(checkpoints["base"]), "--skip-tokenizer-init", "--dtype", "float32",
        "--enable-lora", "--lora-paths", f"a={checkpoints['a']}", "--max-loras-per-batch", "2",
        "--max-lora-rank", "8", "--lora-target-modules", "all",
        log=tmp_path_factory.mktemp("lora-server") / "server.log",
        env={LORA_READ_TIMEOUT_ENV: str(READ_TIMEOUT_S)},
    )  # fmt: skip
    yield proc
    proc.stop()


def _generate(server: ServerProcess, ids, lora_path=None) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": GENERATE, "lora_path": lora_path}
    return httpx.post(f"{server.url}/generate", json=body, timeout=120)


def _completion_logprobs(server: ServerProcess, ids: list[int], model: str) -> list[float]:
    body = {"model": model, "prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["token_logprobs"]


def test_generate_picks_the_adapter_per_prompt(server, checkpoints):
    batch = prompts((6, 19, 11))
    response = _generate(server, batch, ["a", None, "a"])
    assert response.status_code == 200, response.text
    got = [item["output_ids"] for item in response.json()]
    want_a = peft_greedy(checkpoints["base"], checkpoints["a"], batch)
    want_base = peft_greedy(checkpoints["base"], None, batch)
    assert got == [want_a[0], want_base[1], want_a[2]]


def test_model_field_forms(server):
    # NOTE: the repeats hit the radix cache, so their last prompt token is computed alone,
    # not in a block of 13 rows: on some CPUs the float32 matmuls then round differently
    # in the last bits (seen: 5e-7), far below what an adapter changes (~0.1)
    ids = prompts((13,))[0]
    by_name = _completion_logprobs(server, ids, "a")
    assert _completion_logprobs(server, ids, "base:a") == pytest.approx(by_name, abs=1e-4)
    base = _completion_logprobs(server, ids, "base")
    assert max(abs(x - y) for x, y in zip(base, by_name, strict=True)) > 1e-2
    not_an_adapter = _completion_logprobs(server, ids, "some-client-name")
    assert not_an_adapter == pytest.approx(base, abs=1e-4)


def test_unknown_adapters_are_400(server):
    ids = prompts((5,))[0]
    response = _generate(server, ids, "nope")
    assert response.status_code == 400 and "unknown LoRA adapter 'nope'" in response.text
    body = {"model": "base:nope", "prompt": ids, "max_tokens": 2}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and "unknown LoRA adapter 'nope'" in response.text
    bad = httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "nope"}, timeout=60)
    assert bad.status_code == 400


def test_load_and_unload_while_serving(server, checkpoints, tmp_path):
    ids = prompts((9,))[0]
    models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["base", "a"] and models[1]["parent"] == "base"
    body = {"lora_name": "b", "lora_path": str(checkpoints["b"])}
    loaded = httpx.post(f"{server.url}/load_lora_adapter", json=body, timeout=120)
    assert loaded.status_code == 200, loaded.text
    assert set(loaded.json()["loaded_adapters"]) == {"a", "b"}
    assert "b" in [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]]
    again = httpx.post(f"{server.url}/load_lora_adapter", json=body, timeout=60)
    assert again.status_code == 400 and "loaded already" in again.text
    response = _generate(server, ids, "b")
    assert (
        response.json()["output_ids"]
        == peft_greedy(checkpoints["base"], checkpoints["b"], [ids])[0]
    )
    # an adapter this server cannot apply: rank 16 > --max-lora-rank 8
    big = tmp_path / "big"
    build_adapter(checkpoints["base"], big, seed=3, r=16, lora_alpha=16, target_modules=["q_proj"])
    refused = httpx.post(
        f"{server.url}/load_lora_adapter",
        json={"lora_name": "big", "lora_path": str(big)},
        timeout=60,
    )
    assert refused.status_code == 400 and "--max-lora-rank" in refused.text
    _unload_refused_in_flight(server, "b", ids)
    unloaded = httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "b"}, timeout=60)
    assert unloaded.status_code == 200 and set(unloaded.json()["loaded_adapters"]) == {"a"}
    assert _generate(server, ids, "b").status_code == 400
    server.wait_idle_and_free()


def test_a_load_reading_its_files_does_not_stall_serving(server, checkpoints, tmp_path):
    """The adapter's files are read off the scheduler's loop: while a load waits on its
    adapter_config.json (a FIFO nobody writes yet), requests on other adapters finish;
    once the file is written the load completes and the adapter serves."""
    slow = tmp_path / "slow"
    slow.mkdir()
    config = (checkpoints["b"] / "adapter_config.json").read_text()
    (slow / "adapter_model.safetensors").symlink_to(checkpoints["b"] / "adapter_model.safetensors")
    os.mkfifo(slow / "adapter_config.json")
    body = {"lora_name": "slow", "lora_path": str(slow)}
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(httpx.post, f"{server.url}/load_lora_adapter", json=body, timeout=120)
        try:
            ids = prompts((7,))[0]
            body = {"input_ids": ids, "sampling_params": GENERATE, "lora_path": "a"}
            served = httpx.post(f"{server.url}/generate", json=body, timeout=30)
            assert served.status_code == 200, served.text
            assert not load.done()  # still reading
        finally:  # (unblocks the reader whatever happened above)
            with open(slow / "adapter_config.json", "w") as fifo:
                fifo.write(config)
        loaded = load.result(timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert set(loaded.json()["loaded_adapters"]) == {"a", "slow"}
    ids = prompts((9,))[0]
    assert (
        _generate(server, ids, "slow").json()["output_ids"]
        == peft_greedy(checkpoints["base"], checkpoints["b"], [ids])[0]
    )
    unloaded = httpx.post(
        f"{server.url}/unload_lora_adapter", json={"lora_name": "slow"}, timeout=60
    )
    assert unloaded.status_code == 200, unloaded.text
    server.wait_idle_and_free()


def test_a_read_that_never_ends_is_refused_in_time_and_holds_up_no_other_load(
    server, checkpoints, tmp_path
):
    """A load whose adapter_config.json is a FIFO nobody writes never finishes reading:
    another load started after it still completes, and the stuck one is refused once
    $KVFLOW_LORA_READ_TIMEOUT_S has passed (not left hanging); the name is free again."""
    stuck = tmp_path / "stuck"
    stuck.mkdir()
    (stuck / "adapter_model.safetensors").symlink_to(checkpoints["b"] / "adapter_model.safetensors")
    fifo = stuck / "adapter_config.json"
    os.mkfifo(fifo)
    url = f"{server.url}/load_lora_adapter"
    try:
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            load = pool.submit(
                httpx.post, url, json={"lora_name": "stuck", "lora_path": str(stuck)}, timeout=120
            )
            other = httpx.post(
                url, json={"lora_name": "other", "lora_path": str(checkpoints["b"])}, timeout=60
            )
            assert other.status_code == 200, other.text
            assert not load.done()
            refused = load.result(timeout=READ_TIMEOUT_S + 60)
        waited = time.monotonic() - started
    finally:  # the reader blocks opening the FIFO: a writer that closes lets it end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert refused.status_code == 400, refused.text
    assert f"did not end within {READ_TIMEOUT_S} s" in refused.text
    assert READ_TIMEOUT_S <= waited < READ_TIMEOUT_S + 30
    loaded = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    assert {m["id"] for m in loaded} == {"base", "a", "other"}
    again = httpx.post(  # the refused load's name is free again
        url, json={"lora_name": "stuck", "lora_path": str(checkpoints["b"])}, timeout=60
    )
    assert again.status_code == 200, again.text
    for name in ("other", "stuck"):
        unloaded = httpx.post(
            f"{server.url}/unload_lora_adapter", json={"lora_name": name}, timeout=60
        )
        assert unloaded.status_code == 200, unloaded.text
    server.wait_idle_and_free()


def _unload_refused_in_flight(server: ServerProcess, name: str, ids: list[int]) -> None:
    """While a request on ``name`` streams, unloading it is a 400 (it is refused, not
    queued); the request finishes unharmed."""
    params = {**GENERATE, "max_new_tokens": 200}
    body = {"input_ids": ids, "sampling_params": params, "lora_path": name, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        refused = httpx.post(
            f"{server.url}/unload_lora_adapter", json={"lora_name": name}, timeout=60
        )
        assert refused.status_code == 400 and "in flight" in refused.text
        chunks = [line for line in lines if line.startswith("data:")]
    assert chunks[-1] == "data: [DONE]"
    assert '"length"' in chunks[-2]  # it ran to its max_new_tokens
