"""EAGLE and EAGLE3 under prefill/decode disaggregation on CUDA: the target's features of
the prompt travel with the KV through the same-host kernel transport (cuda_ipc) and through
Mooncake, from GPU memory to GPU memory; the decode's head drafts from them in its CUDA
graphs. Greedy tokens equal a unified CUDA engine's, and the decode drafts exactly as a
unified EAGLE engine on the same GPU does (the same acceptance counts), prefix hits on the
prefill included.

Skipped without CUDA; run on the accelerator machine with
``pytest -m gpu tests/pd/test_pd_eagle_gpu.py``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from pd_flags import COMMON
from server_process import ServerProcess, free_port

# the CPU module's models (a fixture), prompts and request helper
from test_pd_eagle import GREEDY, Pair, _generate, _prompts, models  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# (algorithm, KV transport): both heads through the kernel transport, EAGLE through Mooncake
PAIRS = (("EAGLE", "cuda_ipc"), ("EAGLE3", "cuda_ipc"), ("EAGLE", "mooncake"))
CUDA = ("--device", "cuda", "--dtype", "float32")


@pytest.fixture(scope="module")
def cuda_pairs(models, tmp_path_factory) -> Iterator[dict[tuple[str, str], Pair]]:  # noqa: F811
    """A prefill and a decode on the GPU per (algorithm, transport), both with the head's
    flags and the transport's."""
    logs = tmp_path_factory.mktemp("pd-eagle-gpu-logs")
    ports = {key: free_port() for key in PAIRS}
    common = ("--model-path", str(models["target"]), "--skip-tokenizer-init", *COMMON, *CUDA)
    specs: dict[str, tuple[str, ...]] = {}
    for (algorithm, transport), port in ports.items():
        flags = ("--speculative-algorithm", algorithm, "--speculative-num-steps", "3")
        flags += ("--speculative-draft-model-path", str(models[algorithm]))
        flags += ("--disaggregation-transfer-backend", transport, *common)
        name = f"{algorithm}-{transport}"
        specs[f"{name}-prefill"] = ("--role", "prefill", "--bootstrap-port", str(port), *flags)
        trusted = ("--disaggregation-trusted-prefills", f"127.0.0.1:{port}")
        specs[f"{name}-decode"] = ("--role", "decode", *trusted, *flags)
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {
            name: pool.submit(ServerProcess, *flags, log=logs / f"{name}.log")
            for name, flags in specs.items()
        }
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        failed = [f.exception() for f in futures.values() if f.exception() is not None]
        if failed:
            raise failed[0]  # type: ignore[misc]
        yield {
            (a, t): Pair(started[f"{a}-{t}-prefill"], ports[(a, t)], started[f"{a}-{t}-decode"])
            for a, t in PAIRS
        }
    finally:
        for server in started.values():
            server.stop()


def _cuda_engine(models: dict[str, Path], algorithm: str | None = None) -> Any:  # noqa: F811
    """A unified engine on the GPU set up as the servers (float32, chunks of 64, CUDA
    graphs on); with ``algorithm``, drafting with the same head."""
    from kvflow.runtime.engine import Engine

    spec: dict[str, Any] = {}
    if algorithm is not None:
        spec = {
            "speculative_algorithm": algorithm,
            "speculative_draft_model_path": str(models[algorithm]),
            "speculative_num_steps": 3,
        }
    return Engine(
        str(models["target"]),
        skip_tokenizer_init=True,
        dtype="float32",
        device="cuda",
        max_total_tokens=6000,
        context_length=2048,
        chunked_prefill_size=64,
        **spec,
    )


@pytest.fixture(scope="module")
def cuda_plain_tokens(models) -> list[list[int]]:  # noqa: F811
    plain = _cuda_engine(models)
    tokens = [plain.generate(input_ids=p, sampling_params=GREEDY).output_ids for p in _prompts()]
    del plain
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


@pytest.mark.parametrize("algorithm,transport", PAIRS)
def test_cuda_decode_drafts_from_the_prefills_features(
    algorithm,
    transport,
    cuda_pairs,
    models,  # noqa: F811
    cuda_plain_tokens,
):
    pair = cuda_pairs[(algorithm, transport)]
    before = pair.decode.server_info()["stats"]
    got, cached = [], []
    for ids in _prompts():  # one at a time, as the unified engine below runs them
        response = _generate(pair, {"input_ids": ids, "sampling_params": GREEDY})
        assert response.status_code == 200, response.text
        got.append(response.json()["output_ids"])
        cached.append(response.json()["meta_info"]["cached_tokens"])
    assert got == cuda_plain_tokens
    assert cached[3] >= 64 and cached[:3] == [0, 0, 0]  # the prefix hit, on the prefill
    after = pair.decode.wait_idle_and_free()["stats"]
    pair.prefill.wait_idle_and_free()
    unified = _cuda_engine(models, algorithm)
    for ids in _prompts():
        unified.generate(input_ids=ids, sampling_params=GREEDY)
    spec = unified.scheduler.spec
    verified = after["spec_verified_reqs"] - before["spec_verified_reqs"]
    emitted = after["spec_emitted_tokens"] - before["spec_emitted_tokens"]
    assert (verified, emitted) == (spec.verified_reqs, spec.emitted_tokens)
    if algorithm == "EAGLE":  # the identity head's repeats are kept where the target repeats
        assert emitted > verified
    assert spec.drafter.graphs is not None and spec.drafter.graphs.replays > 0
    del unified, spec
    gc.collect()
    torch.cuda.empty_cache()
