"""Every query of the PD dashboard returns data from a real Prometheus scraping a real
prefill/decode pair and its PD router under load (loopback; see prometheus_stack.py)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
sys.path.insert(0, str(Path(__file__).parents[1] / "router"))
sys.path.insert(0, str(Path(__file__).parents[1] / "pd"))

from pd_flags import COMMON, trusting
from prometheus_stack import (
    PROMETHEUS,
    Prometheus,
    dead_panels,
    empty_variables,
    patient_server_start,
)
from router_process import RouterProcess
from server_process import ServerProcess, free_port

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="Debian's prometheus package is not installed (scripts/setup.sh)"
)


@pytest.fixture(scope="module")
def pd_prometheus(model_path, tmp_path_factory) -> Iterator[tuple[Prometheus, float]]:
    logs = tmp_path_factory.mktemp("dashboards-pd")
    bootstrap = free_port()
    started: list[ServerProcess] = []
    router = prometheus = None
    try:
        with patient_server_start():  # one after the other: the machine has 2 cores
            prefill_flags = ("--role", "prefill", "--bootstrap-port", str(bootstrap), *COMMON)
            started.append(ServerProcess(*prefill_flags, log=logs / "prefill.log"))
            decode_flags = ("--role", "decode", *trusting(bootstrap), *COMMON)
            started.append(ServerProcess(*decode_flags, log=logs / "decode.log"))
        prefill, decode = started
        router = RouterProcess(
            "--prefill-urls", f"{prefill.url}#{bootstrap}",
            "--decode-urls", decode.url,
            log=logs / "router.log",
        )  # fmt: skip
        prometheus = Prometheus(
            {
                "runtime": [
                    (prefill.url.removeprefix("http://"), "serve-prefill"),
                    (decode.url.removeprefix("http://"), "serve-decode"),
                ]
            },
            logs,
        )
        prometheus.wait_scraped(jobs=1)
        body = {"model": "x", "max_tokens": 8, "ignore_eos": True}

        def complete(i: int) -> int:
            prompt = f"Once upon a time, tale number {i} began with " * 4
            url = f"{router.url}/v1/completions"
            return httpx.post(url, json={**body, "prompt": prompt}, timeout=300).status_code

        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(complete, range(8)))
        assert statuses == [200] * 8, statuses
        time.sleep(4)
        yield prometheus, time.time()
    finally:
        if prometheus is not None:
            prometheus.stop()
        if router is not None:
            router.stop()
        for server in started:
            server.stop()


def test_every_pd_panel_query_returns_data(pd_prometheus) -> None:
    prometheus, at = pd_prometheus
    dead, checked = dead_panels(prometheus, "kvflow-pd", at)
    assert not dead, "\n".join(dead)
    assert checked >= 6


def test_pd_variable_queries_return_values(pd_prometheus) -> None:
    prometheus, _ = pd_prometheus
    assert not empty_variables(prometheus, "kvflow-pd")
