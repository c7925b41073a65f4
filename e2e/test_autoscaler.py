"""The autoscaler end to end: the operator process against the real control plane, its
pods on kwok nodes, its signals real.

kwok pods run nothing, so the signals come from a real ``kvflow serve`` on loopback through
a real Prometheus: a discovery thread here maps every Ready pod of the role onto that
server as a scrape target labelled with the pod's namespace and name (what a PodMonitor
does for real pods), and the operator reads them with ``--autoscaler-prometheus-url``.
Streaming load on the server (6 clients, 2 running at most: requests queue) must make the
role scale out within the documented time; the size goes to status, an Event and the
Deployment, and drift repair keeps it (``kubectl scale`` is reverted to it). When the load
ends the role scales back in, one replica at a time, only after the stabilization window,
the pods carrying deletion costs first. Reaction times are printed (``-rP``) and recorded
as junit properties.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.k8s import Kube
from e2e.operator_process import OperatorProcess

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "server"))
sys.path.insert(0, str(REPO / "tests" / "operator"))

from prometheus_stack import PROMETHEUS, Prometheus, patient_server_start  # noqa: E402
from server_process import ServerProcess, free_port  # noqa: E402

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus package is not installed"),
]

NAME = "auto"
STABILIZATION_S = 20
TIMINGS = [
    "--autoscaler-interval", "1",
    "--autoscaler-scale-up-window", "3",
    "--autoscaler-scale-up-cooldown", "5",
    "--autoscaler-scale-down-cooldown", "5",
]  # fmt: skip
SPEC = {
    "apiVersion": "kvflow.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": NAME},
    "spec": {
        "mode": "unified",
        "model": {"source": "embedded"},
        "unified": {
            "replicas": 1,
            "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}},
            "autoscaling": {
                "enabled": True,
                "minReplicas": 1,
                "maxReplicas": 3,
                "scaleDownStabilizationSeconds": STABILIZATION_S,
                "targets": {"queuePerReplica": 1},
            },
        },
    },
}


def ready_pods(kube: Kube, ns: str) -> list[dict[str, Any]]:
    selector = f"kvflow.dev/deployment={NAME},kvflow.dev/role=unified"
    items = kube.get_json("pods", "-n", ns, "-l", selector)["items"]
    return [
        p
        for p in items
        if not p["metadata"].get("deletionTimestamp")
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions") or ()
        )
    ]


class Discovery(threading.Thread):
    """Keeps Prometheus' targets = the role's Ready pods, each scraped from the server."""

    def __init__(self, kube: Kube, ns: str, prometheus: Prometheus, server: str) -> None:
        super().__init__(daemon=True)
        self.kube, self.ns, self.prometheus, self.server = kube, ns, prometheus, server
        self.stopped = threading.Event()
        self.pods: tuple[str, ...] = ()

    def run(self) -> None:
        while not self.stopped.wait(0.5):
            try:
                names = tuple(sorted(p["metadata"]["name"] for p in ready_pods(self.kube, self.ns)))
            except Exception:  # the API server is busy: next round
                continue
            if names != self.pods:
                self.prometheus.retarget({"runtime": [(self.server, n) for n in names]})
                self.pods = names


def stream(url: str, i: int) -> int:
    body = {"model": "x", "prompt": f"Tell story {i}:", "max_tokens": 24, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for _ in response.iter_lines():
            pass
        return response.status_code


class Load:
    """``clients`` streaming clients in a loop until stopped; counts statuses."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.clients = url, clients
        self.stopped = threading.Event()
        self.statuses: list[int] = []
        self.pool = ThreadPoolExecutor(clients)

    def start(self) -> None:
        def client(c: int) -> None:
            i = 0
            while not self.stopped.is_set():
                self.statuses.append(stream(self.url, c * 1000 + i))
                i += 1

        for c in range(self.clients):
            self.pool.submit(client, c)

    def stop(self) -> float:
        """Stop sending; returns when the stop was asked (monotonic), after in-flight
        requests finish."""
        asked = time.monotonic()
        self.stopped.set()
        self.pool.shutdown(wait=True)
        return asked


def status_entry(kube: Kube, ns: str) -> dict[str, Any]:
    body = kube.get_json("modeldeployment", NAME, "-n", ns)
    return ((body.get("status") or {}).get("roles") or {}).get("unified", {}).get("autoscaling", {})


def deployment_replicas(kube: Kube, ns: str) -> int:
    return int(kube.get_json("deployment", f"{NAME}-unified", "-n", ns)["spec"]["replicas"])


def metric(url: str, name: str) -> float | None:
    with urllib.request.urlopen(url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + "{") and f'deployment="{NAME}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return None


def wait(predicate: Callable[[], Any], timeout: float, what: str) -> float:
    """Seconds until ``predicate`` is true (polled every 0.25 s)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if predicate():
                return time.monotonic() - start
        except Exception:  # not there yet
            pass
        time.sleep(0.25)
    raise AssertionError(f"not within {timeout}s: {what}")


@pytest.fixture(scope="module")
def setup(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("autoscaler")
    ns = f"as-{uuid.uuid4().hex[:8]}"
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    established = ("wait", "--for=condition=Established", "crd/modeldeployments.kvflow.dev")
    # right after the apply the CRD may have no conditions yet (kubectl wait errors then)
    kube.wait_for(lambda: kube.kubectl(*established, check=False).returncode == 0, 60)
    kube.kubectl("create", "namespace", ns)
    with patient_server_start():
        server = ServerProcess(
            "--max-total-tokens", "6000", "--context-length", "2048",
            "--max-running-requests", "2",
            log=logs / "serve.log",
        )  # fmt: skip
    prometheus = Prometheus({"runtime": []}, logs, namespace=ns)
    metrics_port = free_port()
    operator = OperatorProcess(
        kube.env,
        [ns],
        logs / "operator.log",
        drift_interval=5,
        extra_args=[
            *TIMINGS,
            "--autoscaler-prometheus-url", prometheus.url,
            "--metrics-host", "127.0.0.1",
            "--metrics-port", str(metrics_port),
        ],
    )  # fmt: skip
    discovery = Discovery(kube, ns, prometheus, server.url.removeprefix("http://"))
    try:
        operator.start()
        discovery.start()
        kube.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(SPEC))
        yield {
            "ns": ns,
            "server": server,
            "operator": operator,
            "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
            "discovery": discovery,
        }
    finally:
        discovery.stopped.set()
        operator.stop()
        prometheus.stop()
        server.stop()
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_scale_out_under_load_and_back_in_after_the_window(
    kube: Kube, setup: dict[str, Any], record_property: Callable[[str, object], None]
) -> None:
    ns, metrics = setup["ns"], setup["metrics"]
    # idle: one pod, read through Prometheus, and the decision holds at 1
    wait(lambda: len(ready_pods(kube, ns)) == 1, 120, "the first pod Ready")
    wait(lambda: metric(metrics, "kvflow_autoscaler_reporting_pods") == 1, 60, "pod reporting")
    time.sleep(5)
    assert metric(metrics, "kvflow_autoscaler_desired_replicas") == 1
    assert deployment_replicas(kube, ns) == 1 and status_entry(kube, ns) == {}

    load = Load(setup["server"].url, clients=6)
    load.start()
    try:
        t_status = wait(lambda: status_entry(kube, ns).get("desiredReplicas", 1) >= 2, 120, "up")
        t_deploy = wait(lambda: deployment_replicas(kube, ns) >= 2, 30, "Deployment scaled")
        t_pods = wait(lambda: len(ready_pods(kube, ns)) >= 2, 60, "second pod Ready")
        entry = status_entry(kube, ns)
        assert entry["lastScale"]["direction"] == "up" and "queue" in entry["lastScale"]["reason"]
        # drift repair renders the autoscaler's size: kubectl scale is reverted to it
        wait(lambda: deployment_replicas(kube, ns) == 3, 60, "max size under sustained load")
        kube.kubectl("scale", "deployment", f"{NAME}-unified", "-n", ns, "--replicas=1")
        wait(lambda: deployment_replicas(kube, ns) == 3, 30, "kubectl scale reverted")
    finally:
        t_stop = load.stop()
    wait(lambda: status_entry(kube, ns)["desiredReplicas"] == 2, 180, "first scale-in")
    t_first_in = time.monotonic() - t_stop
    wait(lambda: status_entry(kube, ns)["desiredReplicas"] == 1, 120, "back to 1")
    t_min = time.monotonic() - t_stop
    wait(lambda: deployment_replicas(kube, ns) == 1, 30, "Deployment scaled in")
    entry = status_entry(kube, ns)
    assert entry["lastScale"]["direction"] == "down"
    assert t_first_in >= STABILIZATION_S, t_first_in  # not before the window

    # the scaled-in pods' survivors carry a deletion cost; every request succeeded
    survivors = ready_pods(kube, ns)
    annotations = [p["metadata"].get("annotations") or {} for p in survivors]
    assert all("controller.kubernetes.io/pod-deletion-cost" in a for a in annotations)
    assert load.statuses and set(load.statuses) == {200}, set(load.statuses)
    events = kube.get_json("events", "-n", ns, "--field-selector", f"involvedObject.name={NAME}")[
        "items"
    ]
    reasons = {e["reason"] for e in events}
    assert {"ScaledOut", "ScaledIn"} <= reasons, reasons

    times = {
        "scale_out_decided_s": round(t_status, 1),
        "scale_out_deployment_s": round(t_status + t_deploy, 1),
        "scale_out_pod_ready_s": round(t_status + t_deploy + t_pods, 1),
        "scale_in_first_s_after_load": round(t_first_in, 1),
        "scale_in_to_min_s_after_load": round(t_min, 1),
    }
    for key, value in times.items():
        record_property(key, value)
    print(json.dumps(times), f"({len(load.statuses)} requests, all 200)")
