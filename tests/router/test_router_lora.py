"""LoRA adapters behind the router, on real ``kvflow serve`` workers (a tiny random Llama
and random PEFT adapters, tests/lora/lora_adapters.py): the router loads ``--lora-adapters``
on every worker and unloads what is not listed, routes SGLang's request forms to workers
that have the adapter (cache-aware affinity within one adapter), answers an unknown
adapter itself with a 400, and counts requests per adapter."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_process import FAST_FAULTS, RouterProcess
from server_process import ServerProcess

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))

from lora_adapters import ALL_MODULES, build_adapter, build_base, prompts

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
LORA_FLAGS = ("--enable-lora", "--max-loras-per-batch", "2", "--max-lora-rank", "8")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("router-lora")
    base, a, b = root / "base", root / "a", root / "b"
    build_base(base)
    build_adapter(base, a, seed=1, r=8, lora_alpha=16, target_modules=ALL_MODULES)
    build_adapter(base, b, seed=2, r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"])
    return {"base": base, "a": a, "b": b}


@pytest.fixture(scope="module")
def lora_workers(checkpoints, tmp_path_factory) -> Iterator[list[ServerProcess]]:
    logs = tmp_path_factory.mktemp("router-lora-workers")
    flags = ("--model-path", str(checkpoints["base"]), "--skip-tokenizer-init", "--dtype",
             "float32", *LORA_FLAGS, "--lora-target-modules", "all")  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ServerProcess, *flags, log=logs / f"w{i}.log") for i in range(2)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < 2:
            raise next(f.exception() for f in futures if f.exception() is not None)  # type: ignore[misc]
        yield started
    finally:
        for proc in started:
            proc.stop()


def _loaded(url: str) -> set[str]:
    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return {m["id"] for m in models if m.get("parent")}


def _series(router: RouterProcess, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def _generate(url: str, ids: list[int], lora_path: str | None) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": GREEDY, "lora_path": lora_path}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def _logprobs(url: str, ids: list[int], model: str) -> list[float]:
    body = {"model": model, "prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["token_logprobs"]


def test_router_keeps_the_list_loaded_and_routes_by_adapter(
    lora_workers, checkpoints, tmp_path
) -> None:
    w0, w1 = lora_workers
    router = RouterProcess(
        "--worker-urls", f"{w0.url},{w1.url}", "--policy", "cache_aware",
        "--lora-adapters", f"a={checkpoints['a']}", *FAST_FAULTS, log=tmp_path / "router.log",
    )  # fmt: skip
    try:
        router.wait_for(
            lambda ws: all(w["lora_adapters"] == ["a"] for w in ws.values()), "a loaded on both"
        )
        assert _loaded(w0.url) == _loaded(w1.url) == {"a"}
        ids = prompts((12,))[0]
        direct = _generate(w0.url, ids, "a").json()["output_ids"]
        assert direct != _generate(w0.url, ids, None).json()["output_ids"]
        # SGLang's forms through the router: lora_path, model base:adapter, model adapter
        assert _generate(router.url, ids, "a").json()["output_ids"] == direct
        by_name = pytest.approx(_logprobs(w1.url, ids, "a"), abs=1e-4)  # a cached prefix or not
        assert _logprobs(router.url, ids, "base:a") == by_name
        assert _logprobs(router.url, ids, "a") == by_name
        assert _logprobs(router.url, ids, "base") != by_name
        # an adapter no worker has nor should have: the router's own 400
        refused = _generate(router.url, ids, "nope")
        assert refused.status_code == 400, refused.text
        assert "unknown LoRA adapter 'nope' (loaded: a)" in refused.text
        # affinity within the adapter: one long prompt, the same worker every time
        long_ids = prompts((200,))[0]
        before = _series(router, "kvflow_router_requests_total")
        for _ in range(3):
            assert _generate(router.url, long_ids, "a").status_code == 200
        after = _series(router, "kvflow_router_requests_total")
        grew = {k for k, v in after.items() if v > before.get(k, 0.0)}
        assert len(grew) == 1, grew  # one (route, worker, status) series
        requests = _series(router, "kvflow_router_lora_requests_total")
        assert requests[(("adapter", "a"),)] >= 6
        loaded = _series(router, "kvflow_router_lora_adapter_loaded")
        assert loaded == {(("adapter", "a"), ("worker", w.url)): 1.0 for w in (w0, w1)}
        # an adapter loaded behind the router's back is not in the list: unloaded again
        body = {"lora_name": "b", "lora_path": str(checkpoints["b"])}
        assert httpx.post(f"{w1.url}/load_lora_adapter", json=body, timeout=60).status_code == 200
        deadline = time.monotonic() + 30
        while "b" in _loaded(w1.url) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _loaded(w1.url) == {"a"}
        operations = _series(router, "kvflow_router_lora_operations_total")
        key = (("adapter", "b"), ("operation", "unload"), ("result", "ok"))
        assert operations[key] == 1.0
    finally:
        router.stop()
        for worker in (w0, w1):  # leave the workers as the module found them
            for name in _loaded(worker.url):
                httpx.post(f"{worker.url}/unload_lora_adapter", json={"lora_name": name})


def test_an_adapter_no_worker_has_yet_is_loaded_where_the_load_is_lowest(
    lora_workers, checkpoints
) -> None:
    """A listed adapter no worker has loaded yet (a pod that just became Ready) is loaded on
    the least loaded worker that lists it before the request goes there; an adapter no
    worker lists is a 400, and nothing is loaded for it."""
    import asyncio

    import aiohttp

    from kvflow.runtime.router import AdapterSync, RouterMetrics, WorkerRegistry
    from kvflow.runtime.router.config import BreakerConfig
    from kvflow.runtime.router.discovery import WorkerSpec
    from kvflow.runtime.wire import RequestError

    w0, w1 = lora_workers
    listed = (("b", str(checkpoints["b"])),)

    async def scenario() -> None:
        registry = WorkerRegistry(BreakerConfig(), RouterMetrics())
        for worker in (w0, w1):
            registry.upsert(WorkerSpec(worker.url, lora_adapters=listed))
        registry.get(w0.url).in_flight = 5  # type: ignore[union-attr]  # w1 is less loaded
        async with aiohttp.ClientSession() as session:
            sync = AdapterSync(session, registry.metrics, api_key=None)
            await sync.ready(registry, frozenset({"b"}))
            assert registry.get(w1.url).has_adapters(frozenset({"b"}))  # type: ignore[union-attr]
            with pytest.raises(RequestError) as refused:
                await sync.ready(registry, frozenset({"zzz"}))
            assert (
                refused.value.status == 400
                and "unknown LoRA adapter 'zzz'" in refused.value.message
            )

    try:
        asyncio.run(scenario())
        assert _loaded(w1.url) == {"b"} and _loaded(w0.url) == set()
    finally:
        for worker in (w0, w1):
            for name in _loaded(worker.url):
                httpx.post(f"{worker.url}/unload_lora_adapter", json={"lora_name": name})
