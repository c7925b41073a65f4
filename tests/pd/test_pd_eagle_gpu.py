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

import pytest
import torch
from pd_flags import COMMON
from server_process import free_port

# the CPU module's models (a fixture), prompts, servers and checks
from test_pd_eagle import (  # noqa: F401
    GREEDY,
    Pair,
    _engine,
    _prompts,
    check_drafts_as_unified,
    models,
    started_servers,
)

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
    with started_servers(specs, logs) as started:
        yield {
            (a, t): Pair(started[f"{a}-{t}-prefill"], ports[(a, t)], started[f"{a}-{t}-decode"])
            for a, t in PAIRS
        }


@pytest.fixture(scope="module")
def cuda_plain_tokens(models) -> list[list[int]]:  # noqa: F811
    plain = _engine(models, device="cuda")
    tokens = [plain.generate(input_ids=p, sampling_params=GREEDY).output_ids for p in _prompts()]
    del plain  # (its KV pool and graphs, before the next engine on this GPU)
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
    unified = _engine(models, algorithm, device="cuda")  # CUDA graphs on, as the servers'
    try:
        check_drafts_as_unified(
            cuda_pairs[(algorithm, transport)], unified, cuda_plain_tokens, algorithm
        )
        graphs = unified.scheduler.spec.drafter.graphs
        assert graphs is not None and graphs.replays > 0
    finally:
        del unified
        gc.collect()
        torch.cuda.empty_cache()
