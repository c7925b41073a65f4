"""A real Prometheus (Debian's ``prometheus`` package) scraping loopback targets, and the
checks the dashboard tests run against it: every panel query of a dashboard gives a finite
value, every variable query gives label values."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import server_process
import yaml
from server_process import free_port

DASHBOARDS = Path(__file__).parents[2] / "charts/kvflow-operator/files/dashboards"
PROMETHEUS = shutil.which("prometheus")
NAMESPACE = "kvflow-test"
# Dashboard variables as a user selecting "All" (and one namespace) would set them.
VARIABLES = {
    "$namespace": NAMESPACE,
    "$model": ".*",
    "$deployment": ".*",
    "$__rate_interval": "2m",
}


class Prometheus:
    """``prometheus`` on a free loopback port; ``targets`` is job -> [(host:port, pod)].
    Each target carries the labels a PodMonitor attaches (``namespace``, ``pod``)."""

    def __init__(
        self, targets: dict[str, list[tuple[str, str]]], workdir: Path, namespace: str = NAMESPACE
    ) -> None:
        assert PROMETHEUS is not None
        self.namespace = namespace
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "prometheus.yml"
        self._write(targets)
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={self.config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",  # POST /-/reload after retarget()
                "--log.level=warn",
            ],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus did not start: {self.log.read_text()[-2000:]}")

    def _write(self, targets: dict[str, list[tuple[str, str]]]) -> None:
        jobs = [
            {
                "job_name": job,
                "scrape_interval": "1s",
                "honor_labels": job == "operator",  # the autoscaler's own namespace label
                "static_configs": [
                    {"targets": [addr], "labels": {"namespace": self.namespace, "pod": pod}}
                    for addr, pod in endpoints
                ],
            }
            for job, endpoints in targets.items()
        ]
        self.config.write_text(yaml.safe_dump({"scrape_configs": jobs}))

    def retarget(self, targets: dict[str, list[tuple[str, str]]]) -> None:
        """New scrape targets, live (what a PodMonitor's discovery does as pods come and go)."""
        self._write(targets)
        httpx.post(f"{self.url}/-/reload", timeout=10).raise_for_status()

    def wait_scraped(self, jobs: int, timeout: float = 30) -> None:
        """Until every target of ``jobs`` jobs is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query("up")["data"]["result"]
            if len({r["metric"]["job"] for r in result if r["value"][1] == "1"}) >= jobs:
                return
            time.sleep(0.5)
        raise AssertionError(f"targets not up: {self.query('up')}")

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        return httpx.get(f"{self.url}/api/v1/query", params=params, timeout=30).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def patient_server_start(seconds: float = 600) -> Iterator[None]:
    """Server start-up on a shared, loaded 2-core machine takes longer than the default."""
    before = server_process.START_TIMEOUT_S
    server_process.START_TIMEOUT_S = seconds
    try:
        yield
    finally:
        server_process.START_TIMEOUT_S = before


def panel_queries(dashboard: str) -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target of ``<dashboard>.json``."""
    panels = json.loads((DASHBOARDS / f"{dashboard}.json").read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p["targets"]]


def fill(expr: str) -> str:
    for name, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def dead_panels(prometheus: Prometheus, dashboard: str, at: float) -> tuple[list[str], int]:
    """Queries of ``dashboard`` that fail or give no finite value, and how many ran."""
    dead = []
    checked = 0
    for title, expr in panel_queries(dashboard):
        answer = prometheus.query(fill(expr), at)
        checked += 1
        if answer.get("status") != "success":
            dead.append(f"{dashboard} / {title}: {answer.get('error')}: {expr}")
            continue
        values = [float(item["value"][1]) for item in answer["data"]["result"]]
        if not any(math.isfinite(v) for v in values):
            dead.append(f"{dashboard} / {title}: no finite value ({values}): {expr}")
    return dead, checked


def empty_variables(prometheus: Prometheus, dashboard: str) -> list[str]:
    """Query variables of ``dashboard`` whose ``label_values(...)`` gives nothing."""
    empty = []
    templating = json.loads((DASHBOARDS / f"{dashboard}.json").read_text())["templating"]
    for var in templating["list"]:
        if var["type"] != "query":
            continue
        text = var["query"].removeprefix("label_values(").removesuffix(")")
        selector, _, label = text.rpartition(",")
        params: dict[str, Any] = {}
        if selector:
            params["match[]"] = fill(selector.strip())
        answer = httpx.get(
            f"{prometheus.url}/api/v1/label/{label.strip()}/values", params=params, timeout=30
        ).json()
        if answer.get("status") != "success" or not answer.get("data"):
            empty.append(f"{dashboard} / ${var['name']}: {var['query']}")
    return empty
