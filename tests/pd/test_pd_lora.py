"""LoRA under prefill/decode disaggregation: the router sends the request, ``lora_path``
included, to both sides, so the decode runs the prefill's adapter; the tokens equal
transformers + PEFT's."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from pd_flags import trusting
from router_process import RouterProcess
from server_process import ServerProcess, free_port

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))
from lora_adapters import ALL_MODULES, MAX_NEW, build_adapter, build_base, peft_greedy, prompts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pd-lora")
    build_base(root / "base")
    build_adapter(root / "base", root / "a", seed=1, r=8, lora_alpha=16, target_modules=ALL_MODULES)
    return {"base": root / "base", "a": root / "a"}


@pytest.fixture(scope="module")
def router(checkpoints, tmp_path_factory) -> Iterator[RouterProcess]:
    logs = tmp_path_factory.mktemp("pd-lora-logs")
    bootstrap_port = free_port()
    common = (
        "--model-path", str(checkpoints["base"]), "--skip-tokenizer-init", "--dtype", "float32",
        "--chunked-prefill-size", "8", "--enable-lora", "--lora-paths", f"a={checkpoints['a']}",
    )  # fmt: skip
    specs = {
        "prefill": ("--role", "prefill", "--bootstrap-port", str(bootstrap_port), *common),
        "decode": ("--role", "decode", *trusting(bootstrap_port), *common),
    }
    with ThreadPoolExecutor(2) as pool:
        futures = {
            n: pool.submit(ServerProcess, *f, log=logs / f"{n}.log") for n, f in specs.items()
        }
    started = {n: f.result() for n, f in futures.items() if f.exception() is None}
    proc = None
    try:
        failed = [f.exception() for f in futures.values() if f.exception() is not None]
        if failed:
            raise failed[0]  # type: ignore[misc]
        proc = RouterProcess(
            "--prefill-urls", f"{started['prefill'].url}#{bootstrap_port}",
            "--decode-urls", started["decode"].url, log=logs / "router.log",
        )  # fmt: skip
        yield proc
    finally:
        if proc is not None:
            proc.stop()
        for server in started.values():
            server.stop()


def test_decode_runs_the_prefills_adapter(router, checkpoints):
    batch = prompts((21, 6))
    params = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    got = []
    for ids, adapter in zip(batch, ["a", None], strict=True):
        body = {"input_ids": ids, "sampling_params": params, "lora_path": adapter}
        response = httpx.post(f"{router.url}/generate", json=body, timeout=180)
        assert response.status_code == 200, response.text
        got.append(response.json()["output_ids"])
    assert got[0] == peft_greedy(checkpoints["base"], checkpoints["a"], batch[:1])[0]
    assert got[1] == peft_greedy(checkpoints["base"], None, batch[1:])[0]
