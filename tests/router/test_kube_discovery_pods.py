"""Pods as workers, without a cluster: which pod is a worker, its URL, and the sink's view."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from discovery_testing import RecordingSink, pod

from kvflow import contract
from kvflow.operator import parse_model_deployment, render_children
from kvflow.runtime.router.discovery import PodWorkers, WorkerSpec, worker_spec_from_pod

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_a_ready_worker_pod_is_a_worker_at_its_named_port() -> None:
    assert worker_spec_from_pod(pod()) == WorkerSpec("http://127.0.0.11:8100", "unified")
    no_ports = pod(ports=[])
    assert worker_spec_from_pod(no_ports) == WorkerSpec(
        f"http://127.0.0.11:{contract.DEFAULT_API_PORT}", "unified"
    )
    ipv6 = worker_spec_from_pod(pod(ip="fd00::7"))
    assert ipv6 is not None and ipv6.url == "http://[fd00::7]:8100"


@pytest.mark.parametrize(
    "case",
    [
        pod(ready=False),
        pod(ip=None),
        pod(role="router"),
        pod(role="mooncake-master"),
        pod(role=None),
    ],
    ids=["not-ready", "no-ip", "router", "mooncake-master", "no-role"],
)
def test_pods_that_get_no_traffic(case: dict[str, Any]) -> None:
    assert worker_spec_from_pod(case) is None


def test_terminating_and_conditionless_pods_get_no_traffic() -> None:
    terminating = pod()
    terminating["metadata"]["deletionTimestamp"] = "2026-11-23T12:00:00Z"
    assert worker_spec_from_pod(terminating) is None
    pending = pod()
    del pending["status"]["conditions"]
    assert worker_spec_from_pod(pending) is None


def test_prefill_bootstrap_port_from_annotation_then_named_port() -> None:
    ports = [
        {"name": contract.API_PORT_NAME, "containerPort": 8000},
        {"name": contract.BOOTSTRAP_PORT_NAME, "containerPort": 9001},
    ]
    annotated = pod(role="prefill", ports=ports, annotations={"kvflow.dev/bootstrap-port": "9000"})
    assert worker_spec_from_pod(annotated) == WorkerSpec("http://127.0.0.11:8000", "prefill", 9000)
    bad = pod(role="prefill", ports=ports, annotations={"kvflow.dev/bootstrap-port": "x"})
    assert worker_spec_from_pod(bad) == WorkerSpec("http://127.0.0.11:8000", "prefill", 9001)
    assert worker_spec_from_pod(pod(role="prefill")) == WorkerSpec(
        "http://127.0.0.11:8100", "prefill", None
    )
    # Only prefill workers have a bootstrap port.
    decode = pod(role="decode", ports=ports, annotations={"kvflow.dev/bootstrap-port": "9000"})
    assert worker_spec_from_pod(decode) == WorkerSpec("http://127.0.0.11:8000", "decode")


def test_the_operators_pod_templates_read_as_workers() -> None:
    docs = yaml.safe_load_all((EXAMPLES / "disaggregated-hicache.yaml").read_text())
    (body,) = [d for d in docs if d["kind"] == "ModelDeployment"]
    body["metadata"].update(namespace="ns", uid="u-1", generation=1)
    md = parse_model_deployment(body)
    found = {}
    for child in render_children(md):
        if child["kind"] != "Deployment":
            continue
        template = copy.deepcopy(child["spec"]["template"])
        template["status"] = {
            "podIP": "10.0.0.9",
            "conditions": [{"type": "Ready", "status": "True"}],
        }
        spec = worker_spec_from_pod(template)
        found[child["metadata"]["name"]] = spec
    assert found == {
        "smollm2-pd-prefill": WorkerSpec(
            "http://10.0.0.9:8000", "prefill", md.kv_transfer.bootstrap_port
        ),
        "smollm2-pd-decode": WorkerSpec("http://10.0.0.9:8000", "decode"),
        "smollm2-pd-router": None,
        "smollm2-pd-mooncake-master": None,
    }


def test_pod_workers_tell_the_sink_only_changes() -> None:
    sink = RecordingSink()
    table = PodWorkers(sink)
    a, b = WorkerSpec("http://127.0.0.1:8000"), WorkerSpec("http://127.0.0.2:8000")
    table.set("ns/a", a)
    table.set("ns/a", a)  # unchanged: no call
    table.set("ns/b", None)  # not a worker, never was: no call
    table.set("ns/b", b)
    table.set("ns/a", None)
    assert sink.calls == [("upsert", a.url), ("upsert", b.url), ("remove", a.url)]
    table.replace({"ns/c": a, "ns/b": None})  # b gone from the list, c new
    assert sink.workers == {a.url: a} and table.workers == {"ns/c": a}


def test_a_url_shared_by_two_pods_stays_until_both_leave() -> None:
    sink = RecordingSink()
    table = PodWorkers(sink)
    url = "http://127.0.0.1:8000"
    table.set("ns/old", WorkerSpec(url))
    table.set("ns/new", WorkerSpec(url, "prefill", 9000))  # reused IP, seen before old's delete
    table.set("ns/old", None)
    assert sink.workers == {url: WorkerSpec(url, "prefill", 9000)}
    table.set("ns/new", None)
    assert sink.workers == {}
