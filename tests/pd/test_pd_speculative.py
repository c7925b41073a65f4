"""Speculative decoding under prefill/decode disaggregation: the decode speculates (NGRAM),
the prefill and the router are unchanged; the tokens equal the plain greedy engine's."""

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
from lora_adapters import build_base, prompts

MAX_NEW = 24


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pd-spec") / "base"
    build_base(folder)
    return folder


@pytest.fixture(scope="module")
def router(base, tmp_path_factory) -> Iterator[RouterProcess]:
    logs = tmp_path_factory.mktemp("pd-spec-logs")
    bootstrap_port = free_port()
    common = ("--model-path", str(base), "--skip-tokenizer-init", "--dtype", "float32")
    spec = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4")
    specs = {
        "prefill": ("--role", "prefill", "--bootstrap-port", str(bootstrap_port), *common),
        "decode": ("--role", "decode", *trusting(bootstrap_port), *common, *spec),
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
        info = started["decode"].wait_idle_and_free()
        assert info["stats"]["spec_verified_reqs"] > 0  # the decode ran verify steps
    finally:
        if proc is not None:
            proc.stop()
        for server in started.values():
            server.stop()


def test_decode_speculates_and_keeps_greedy_tokens(router, base):
    from kvflow.runtime.engine import Engine

    batch = prompts((21, 6, 40))
    batch[2] = batch[2][:10] * 4  # repeats: NGRAM drafts from the prompt
    params = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    got = []
    for ids in batch:
        body = {"input_ids": ids, "sampling_params": params}
        response = httpx.post(f"{router.url}/generate", json=body, timeout=180)
        assert response.status_code == 200, response.text
        got.append(response.json()["output_ids"])
    plain = Engine(str(base), skip_tokenizer_init=True, dtype="float32")
    want = [r.output_ids for r in plain.generate(input_ids=batch, sampling_params=params)]
    assert got == want
