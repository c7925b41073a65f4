"""EAGLE and EAGLE3 under prefill/decode disaggregation: the prefill, started with the same
``--speculative-*`` flags, keeps the target's features of every prompt token and sends them
with the KV; the decode's head reads them and drafts. Greedy tokens equal the plain engine's,
prefix hits on the prefill included, and the decode drafts exactly as a unified EAGLE engine
does (the same acceptance counts: a head fed zeros would draft otherwise); a decode whose
prefill keeps another head's features is refused with the reason; an aborted request leaves
both sides idle, the head's KV pool too."""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
from pd_flags import COMMON
from server_process import ServerProcess, free_port

sys.path.insert(0, str(Path(__file__).parents[1] / "speculative"))
from eagle_checkpoints import TINY, write_eagle3_head, write_eagle_head

pytestmark = pytest.mark.slow

MAX_NEW = 24
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
ALGORITHMS = ("EAGLE", "EAGLE3")


class Pair(NamedTuple):
    prefill: ServerProcess
    bootstrap_port: int
    decode: ServerProcess


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama with peaked logits (3 layers: EAGLE-3 reads layers 0, 1, 2) and a
    head per algorithm: EAGLE's passes the target's feature through (its drafts are right
    only where the features are: every draft repeats the request's last token), EAGLE-3's
    is random."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("pd-eagle")
    torch.manual_seed(0)
    shape = {k: v for k, v in TINY.items() if k != "architectures"}
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).float()
    for param in target.parameters():
        if param.dim() > 1:
            param.data.normal_(0, 0.08)
    target.save_pretrained(root / "target")
    return {
        "target": root / "target",
        "EAGLE": Path(write_eagle_head(root / "eagle", identity=True)),
        "EAGLE3": Path(write_eagle3_head(root / "eagle3")),
    }


@pytest.fixture(scope="module")
def pairs(models, tmp_path_factory) -> Iterator[dict[str, Pair]]:
    """A prefill and a decode per algorithm, both with the head's flags; each decode also
    trusts the other algorithm's prefill (the mismatch test pairs them)."""
    logs = tmp_path_factory.mktemp("pd-eagle-logs")
    ports = {algorithm: free_port() for algorithm in ALGORITHMS}
    trusted = ("--disaggregation-trusted-prefills", *(f"127.0.0.1:{p}" for p in ports.values()))
    common = ("--model-path", str(models["target"]), "--skip-tokenizer-init", *COMMON)
    specs: dict[str, tuple[str, ...]] = {}
    for algorithm in ALGORITHMS:
        spec = ("--speculative-algorithm", algorithm)
        spec += ("--speculative-draft-model-path", str(models[algorithm]))
        spec += ("--speculative-num-steps", "3")
        port = str(ports[algorithm])
        specs[f"{algorithm}-prefill"] = ("--role", "prefill", "--bootstrap-port", port)
        specs[f"{algorithm}-prefill"] += (*common, *spec)
        specs[f"{algorithm}-decode"] = ("--role", "decode", *trusted, *common, *spec)
    with started_servers(specs, logs) as started:
        yield {
            a: Pair(started[f"{a}-prefill"], ports[a], started[f"{a}-decode"]) for a in ALGORITHMS
        }


@contextmanager
def started_servers(specs: dict[str, tuple[str, ...]], logs: Path) -> Iterator[dict[str, Any]]:
    """A server per name with its flags, started at once (logs ``logs/<name>.log``), all
    stopped on exit; the first start-up error is raised once the others have stopped."""
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
        yield started
    finally:
        for server in started.values():
            server.stop()


def _prompts() -> list[list[int]]:
    """Prompts of 5, 30 and 90 tokens (two chunks of 64 on the prefill), then one that
    shares the last one's first 70 tokens: a prefix hit on the prefill."""
    rng = random.Random(1)
    prompts = [[rng.randrange(95) for _ in range(n)] for n in (5, 30, 90)]
    return [*prompts, prompts[2][:70] + prompts[0]]


def _generate(pair: Pair, body: dict[str, Any]) -> httpx.Response:
    """The request through the pair, as a router sends it: both halves at once with the
    same bootstrap room; the decode's answer."""
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.bootstrap_port}
    body = {**body, **room, "bootstrap_room": random.getrandbits(63)}
    with ThreadPoolExecutor(2) as pool:
        prefilled = pool.submit(httpx.post, f"{pair.prefill.url}/generate", json=body, timeout=180)
        decoded = pool.submit(httpx.post, f"{pair.decode.url}/generate", json=body, timeout=180)
        assert prefilled.result().status_code == 200, prefilled.result().text
        return decoded.result()


def _engine(models: dict[str, Path], algorithm: str | None = None, device: str = "cpu") -> Any:
    """The unified engine the pair is compared with, set up as the servers (float32, chunks
    of 64, on ``device``); with ``algorithm``, drafting with the same head."""
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
        device=device,
        max_total_tokens=6000,
        context_length=2048,
        chunked_prefill_size=64,
        **spec,
    )


@pytest.fixture(scope="module")
def plain_tokens(models) -> list[list[int]]:
    plain = _engine(models)
    return [plain.generate(input_ids=p, sampling_params=GREEDY).output_ids for p in _prompts()]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_decode_drafts_from_the_prefills_features(algorithm, pairs, models, plain_tokens):
    check_drafts_as_unified(pairs[algorithm], _engine(models, algorithm), plain_tokens, algorithm)


def check_drafts_as_unified(pair: Pair, unified: Any, plain_tokens: list, algorithm: str) -> None:
    """The prompts through ``pair`` one at a time give ``plain_tokens`` (the last one a
    prefix hit on the prefill), and its decode drafted as the ``unified`` EAGLE engine does
    over the same prompts: the same verified request-steps and kept tokens."""
    before = pair.decode.server_info()["stats"]
    got, cached = [], []
    for ids in _prompts():  # one at a time, as the unified engine below runs them
        response = _generate(pair, {"input_ids": ids, "sampling_params": GREEDY})
        assert response.status_code == 200, response.text
        got.append(response.json()["output_ids"])
        cached.append(response.json()["meta_info"]["cached_tokens"])
    assert got == plain_tokens
    assert cached[3] >= 64 and cached[:3] == [0, 0, 0]  # the prefix hit, on the prefill
    after = pair.decode.wait_idle_and_free()["stats"]
    pair.prefill.wait_idle_and_free()
    for ids in _prompts():
        unified.generate(input_ids=ids, sampling_params=GREEDY)
    spec = unified.scheduler.spec
    verified = after["spec_verified_reqs"] - before["spec_verified_reqs"]
    emitted = after["spec_emitted_tokens"] - before["spec_emitted_tokens"]
    # every request-step drafted as the unified engine's did and kept as many tokens
    assert (verified, emitted) == (spec.verified_reqs, spec.emitted_tokens)
    if algorithm == "EAGLE":  # the identity head's repeats are kept where the target repeats
        assert emitted > verified


def test_an_aborted_request_leaves_both_sides_idle(pairs):
    pair = pairs["EAGLE"]
    long = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}  # (a 256 context)
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.bootstrap_port}
    body = {"input_ids": _prompts()[1], "sampling_params": long, **room}
    body["bootstrap_room"] = random.getrandbits(63)
    rid = f"pd-eagle-abort-{body['bootstrap_room']}"
    with ThreadPoolExecutor(2) as pool:
        prefilled = pool.submit(httpx.post, f"{pair.prefill.url}/generate", json=body, timeout=180)
        decoding = pool.submit(
            httpx.post, f"{pair.decode.url}/generate", json={**body, "rid": rid}, timeout=180
        )
        assert prefilled.result().status_code == 200
        while pair.decode.server_info()["stats"]["spec_draft_kv_tokens"] == 0:
            assert not decoding.done(), decoding.result().text
            time.sleep(0.02)  # until the head holds the request's KV: it is decoding
        aborted = httpx.post(f"{pair.decode.url}/abort_request", json={"rid": rid}, timeout=30)
        assert aborted.status_code == 200, aborted.text
        assert decoding.result().status_code == 499  # SGLang's client-abort status
    pair.decode.wait_idle_and_free(timeout=30)  # the head's KV pool too
    pair.prefill.wait_idle_and_free(timeout=30)


def test_a_decode_whose_prefill_keeps_other_features_is_refused(pairs):
    """The EAGLE-3 decode sent to the EAGLE prefill: its registration is refused, naming
    both sides' features, and the request ends at once with that error (a 503, which a
    router may retry elsewhere); the prefill frees the unclaimed room's KV on its timeout."""
    body = {"input_ids": _prompts()[1], "sampling_params": GREEDY}
    response = _generate(
        Pair(pairs["EAGLE"].prefill, pairs["EAGLE"].bootstrap_port, pairs["EAGLE3"].decode), body
    )
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert (
        "refused by the prefill: KV layout mismatch: EAGLE features per slot differs (local "
        "'final-norm hidden state x64 float32', peer 'inputs of layers 0,1,2 x192 float32')"
    ) in message
    pairs["EAGLE3"].decode.wait_idle_and_free(timeout=30)
    pairs["EAGLE"].prefill.wait_idle_and_free(timeout=60)
