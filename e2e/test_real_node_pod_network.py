"""Several pods of one role on the real node, on a real pod network: fail-over when a
worker pod is deleted under load, the autoscaler scaling a role out and back in, and one
model over two pods (a LeaderWorkerSet group running TP=2 across them, its worker finding
the leader through the node's cluster DNS).

Host-network pods of one role collide on their host port, so these tests start a second
real node in pod-network mode (`e2e.k8s.realnode.PodNetwork`): containerd and the kubelet
run in a network namespace the harness creates, a bridge CNI gives every pod an address
of its own there, and relays on root loopback are the only way in (the test reaches the
router pod and the operator's /metrics through `RealNode.forward`). The operator runs as
a pod on that node (the chart, from the host base image with this checkout mounted): the
router and the autoscaler's collector reach worker pods at their pod IPs.

The worker and router pods run the operator's default runtime and router images, built
here from images/*.Dockerfile (the runtime's CPU flavour) without a registry and imported
into this node's containerd (`e2e.images`); nothing of this checkout is mounted into them.
The ModelDeployments differ from a user's in per-role pod settings (`imagePullPolicy:
Never`, the seeded model cache, the node's placement, lower CPU requests) and
in the router policy: `round_robin`, so the deleted pod and the new replica really take
traffic. Times are printed (`-rP`) and recorded as junit properties.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.chart_release import install_operator_chart
from e2e.k8s import ControlPlane, Kube, resolve_binaries
from e2e.k8s.bins import NODE_BINARIES
from e2e.k8s.lws import LwsController
from e2e.k8s.realnode import (
    NodeUnavailable,
    PodNetwork,
    RealNode,
    RealNodeConfig,
    missing_capability,
)
from e2e.k8s.realnode.imagebuild import BuiltImage, import_built
from e2e.k8s.realnode.podnet import pod_network_missing
from e2e.k8s.realnode.product import adapt_to_pod_network, pod_network_chart_values, seed_embedded

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "parallel"))  # tiny_llama
EXAMPLE = REPO / "examples" / "unified-embedded.yaml"
NODE = "real-node-pods"
PORT = 8000  # the runtime's and the router's default port (kvflow.contract)
OPERATOR_METRICS_PORT = 8081  # the chart's default metrics.port
MODEL = "SmolLM2-135M-Instruct"
STABILIZATION_S = 20
# Runtime arguments of the workers: a KV pool of 4,096 tokens (the CPU default is 1 GB a
# pod), and first-come-first-served scheduling. With the default `lpm` (longest prefix
# first) a closed-loop client whose previous prompt is cached keeps winning, and a queued
# request of another client waited over 60 s under the autoscaler test's load.
WORKER_ARGS = [
    "--max-total-tokens",
    "4096",
    "--context-length",
    "2048",
    "--schedule-policy",
    "fcfs",
]
REQUEST_TIMEOUT_S = 60.0
AUTOSCALER = {
    "intervalSeconds": 1,
    "scaleUpWindowSeconds": 3,
    "scaleUpCooldownSeconds": 5,
    "scaleDownCooldownSeconds": 5,
}
# docs/operator.md: a scale-out within `interval + scale-up window` of sustained pressure;
# the slack covers a scrape's age and a loaded 2-core machine.
SCALE_OUT_BOUND_S = AUTOSCALER["intervalSeconds"] + AUTOSCALER["scaleUpWindowSeconds"] + 20


@pytest.fixture(scope="module")
def pod_node(control_plane: ControlPlane) -> Iterator[RealNode]:
    """A real node in pod-network mode, beside the session's kwok (and real) nodes."""
    reason = missing_capability() or pod_network_missing()
    if reason is not None:
        pytest.skip(f"this machine cannot run a pod-network real node: {reason}")
    plane = control_plane.config
    config = RealNodeConfig(
        plane.state_dir / "nodes" / NODE,
        name=NODE,
        pod_network=PodNetwork(service_ip=plane.service_ip, dns_ip=plane.dns_ip),
    )
    bins = resolve_binaries(NODE_BINARIES)
    node = RealNode(
        bins["kubelet"], config, control_plane.kube, plane.pki_dir / "ca.crt",
        coredns=bins["coredns"],
    )  # fmt: skip
    root_before = root_addresses()
    try:
        node.start()
    except NodeUnavailable as err:
        pytest.skip(f"this machine cannot run a pod-network real node: {err}")
    yield node
    root_during = root_addresses()
    node.stop()
    # every pod, bridge and veth address lived in the node's namespace
    assert root_during == root_before, (root_before, root_during)


def root_addresses() -> list[str]:
    """The root network namespace's interfaces and addresses (`ip -o addr`)."""
    listed = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True)
    return sorted(" ".join(line.split()[1:4]) for line in listed.stdout.splitlines())


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted embedded model and the built CPU kernels, readable by the pods."""
    return seed_embedded(tmp_path_factory.mktemp("seed") / "cache")


@pytest.fixture(scope="module")
def pod_node_images(pod_node: RealNode, built_images: dict[str, BuiltImage]) -> dict[str, str]:
    """The built runtime and router images, imported into the pod-network node."""
    return {name: import_built(pod_node.config, image) for name, image in built_images.items()}


@pytest.fixture(scope="module")
def namespaces(
    kube: Kube, pod_node: RealNode, pod_node_images: dict[str, str]
) -> Iterator[dict[str, str]]:
    names = {
        "failover": f"pn-fo-{uuid.uuid4().hex[:6]}",
        "autoscale": f"pn-as-{uuid.uuid4().hex[:6]}",
        "lws": f"pn-lws-{uuid.uuid4().hex[:6]}",
    }
    for name in names.values():
        kube.kubectl("create", "namespace", name)
    yield names
    for name in names.values():
        kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(
    kube: Kube,
    pod_node: RealNode,
    namespaces: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """The chart's operator as a pod on the pod-network node, its /metrics forwarded."""
    namespace, release = f"kvflow-pn-{uuid.uuid4().hex[:6]}", "kvflow-pn"
    values = pod_network_chart_values(pod_node.config.label_value, list(namespaces.values()))
    values.update(driftIntervalSeconds=5, autoscaler=AUTOSCALER)
    seconds = install_operator_chart(
        kube, release, namespace, values, tmp_path_factory.mktemp("pn-values")
    )
    print(f"helm install (operator pod running on the pod network): {seconds:.1f}s")
    (pod,) = kube.get_json("pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={release}")[
        "items"
    ]
    assert pod["spec"]["nodeName"] == NODE and not pod["spec"].get("hostNetwork")
    metrics = pod_node.forward(pod["status"]["podIP"], OPERATOR_METRICS_PORT)
    yield {"namespace": namespace, "pod": pod["metadata"]["name"], "metrics_port": metrics}
    kube.helm("uninstall", release, "-n", namespace, "--wait", check=False)
    kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


# --- helpers -------------------------------------------------------------------------


def wait(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    diagnose: Callable[[], str] | None = None,
) -> float:
    """Seconds until `predicate` is truthy (polled every 0.25 s); on a time-out the
    assertion carries what `diagnose` returns then."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if predicate():
                return time.monotonic() - start
        except (OSError, httpx.HTTPError, KeyError, ValueError):
            pass  # not there yet
        time.sleep(0.25)
    raise AssertionError(f"not within {timeout}s: {what}\n{diagnose() if diagnose else ''}")


def pods(kube: Kube, ns: str, name: str, role: str) -> list[dict[str, Any]]:
    """The role's pods that are not being deleted."""
    selector = f"kvflow.dev/deployment={name},kvflow.dev/role={role}"
    items = kube.get_json("pods", "-n", ns, "-l", selector)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = pod["status"].get("conditions") or ()
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def worker_url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:{PORT}"


def router_workers(port: int) -> dict[str, bool]:
    """The router's workers: URL -> healthy."""
    listed = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=5).json()["workers"]
    return {w["url"]: bool(w["healthy"]) for w in listed}


def answered_by(port: int, worker: str) -> float:
    """Requests the router answered 200 from `worker` (kvflow_router_requests_total)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    wanted = ("kvflow_router_requests_total{", f'worker="{worker}"', 'status="200"')
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(wanted[0]) and all(w in line for w in wanted[1:])
    )


def chat(port: int, content: str, max_tokens: int = 8, timeout: float = 60) -> httpx.Response:
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=payload, timeout=timeout)


@dataclass(frozen=True)
class Outcome:
    """One client request: when it started (seconds from the stream's start), its status
    (0: no HTTP answer) and, unless it succeeded, what came back."""

    started_s: float
    status: int
    detail: str = ""


class Stream:
    """`clients` closed-loop clients (one request in flight each, non-streamed, `pause_s`
    between two) sending through the router until stopped; every outcome is kept. A request without an answer
    within `REQUEST_TIMEOUT_S` fails."""

    def __init__(self, port: int, clients: int, max_tokens: int, pause_s: float = 0.0) -> None:
        self.port, self.max_tokens, self.pause_s = port, max_tokens, pause_s
        self.stopped = threading.Event()
        self.outcomes: list[Outcome] = []
        self.in_flight: dict[int, float] = {}  # client -> when its request started
        self.started = time.monotonic()
        self.threads = [
            threading.Thread(target=self._client, args=(c,), daemon=True) for c in range(clients)
        ]
        for thread in self.threads:
            thread.start()

    def _client(self, client: int) -> None:
        i = 0
        while not self.stopped.is_set():
            begin = self.in_flight[client] = time.monotonic() - self.started
            try:
                response = chat(self.port, f"Client {client}, question {i}: name a colour.",
                                self.max_tokens, REQUEST_TIMEOUT_S)  # fmt: skip
                detail = "" if response.status_code == 200 else response.text[:300]
                self.outcomes.append(Outcome(begin, response.status_code, detail))
            except httpx.HTTPError as err:
                self.outcomes.append(Outcome(begin, 0, f"{type(err).__name__}: {err}"))
            del self.in_flight[client]
            i += 1
            self.stopped.wait(self.pause_s)

    def stop(self) -> float:
        """Stop sending and wait for the requests in flight; returns when it was asked."""
        asked = time.monotonic()
        self.stopped.set()
        for thread in self.threads:
            thread.join(timeout=REQUEST_TIMEOUT_S + 10)
        for begin in list(self.in_flight.values()):  # a client stuck past its timeout
            self.outcomes.append(Outcome(begin, 0, "no outcome when the stream stopped"))
        return asked

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200]


def diagnose(kube: Kube, ns: str) -> str:
    """The namespace's objects, the ModelDeployment's status and each pod's log tail."""
    parts = [kube.kubectl("get", "md,deploy,pods", "-n", ns, "-o", "wide", check=False).stdout]
    for md in kube.get_json("md", "-n", ns)["items"]:
        parts.append(yaml.safe_dump(md.get("status", {})))
    for pod in kube.get_json("pods", "-n", ns)["items"]:
        name = pod["metadata"]["name"]
        try:
            logs = kube.kubectl("logs", "-n", ns, name, "--tail=20", check=False, timeout=20)
            parts.append(f"--- {name}\n{logs.stdout}{logs.stderr}")
        except subprocess.TimeoutExpired:
            parts.append(f"--- {name}: kubectl logs took over 20 s")
    events = kube.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False)
    return "\n".join([*parts, events.stdout[-2500:]])


def deploy(
    kube: Kube, node: RealNode, ns: str, body: dict[str, Any], workers: int
) -> dict[str, Any]:
    """Apply `body` in `ns`; wait until the router pod answers a chat request with
    `workers` healthy workers; return the forwarded router port and the times."""
    name = body["metadata"]["name"]
    started = time.monotonic()
    kube.apply({**body, "metadata": {**body["metadata"], "namespace": ns}})
    why = lambda: diagnose(kube, ns)  # noqa: E731

    def router_pod() -> dict[str, Any] | None:
        listed = pods(kube, ns, name, "router")
        return listed[0] if listed and listed[0]["status"].get("podIP") else None

    try:
        kube.wait_for(router_pod, timeout=180, interval=0.5, what="the router pod's address")
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{why()}") from err
    pod = router_pod()
    assert pod is not None and pod["spec"]["nodeName"] == NODE
    port = node.forward(pod["status"]["podIP"], PORT)
    wait(lambda: chat(port, "What is the capital of France?", timeout=120).status_code == 200,
         300, "a chat answer through the router", why)  # fmt: skip
    first_answer = time.monotonic() - started

    wait(lambda: _healthy_workers(kube, port, ns, name) == workers, 240,
         f"{workers} workers Ready and healthy in the router", why)  # fmt: skip
    return {"port": port, "first_answer_s": first_answer, "all_s": time.monotonic() - started}


def remove(kube: Kube, ns: str, name: str) -> None:
    """Delete the ModelDeployment and wait (bounded) until its pods are gone, so the next
    test's workers do not share the machine with these."""
    kube.kubectl("delete", "md", name, "-n", ns, "--wait=false", check=False)
    selector = f"kvflow.dev/deployment={name}"
    try:
        kube.wait_for(
            lambda: not kube.get_json("pods", "-n", ns, "-l", selector)["items"],
            timeout=90,
            what=f"{name}'s pods gone",
        )
    except TimeoutError as err:
        print(f"cleanup: {err}")


def _healthy_workers(kube: Kube, port: int, ns: str, name: str) -> int:
    """How many Ready worker pods the router lists as healthy (0 when it lists another)."""
    ready = {worker_url(p) for p in pods(kube, ns, name, "unified") if is_ready(p)}
    listed = router_workers(port)
    healthy = {url for url, ok in listed.items() if ok}
    return len(ready) if healthy == ready == set(listed) else 0


def example(seed: Path, name: str, replicas: int) -> dict[str, Any]:
    (body,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d["kind"] == "ModelDeployment"]
    body = copy.deepcopy(body)
    body["metadata"]["name"] = name
    body["spec"]["router"]["policy"] = "round_robin"
    body["spec"]["unified"]["extraArgs"] = WORKER_ARGS
    return adapt_to_pod_network(body, "pod-network", replicas, seed, images=True)


# --- tests ---------------------------------------------------------------------------


def test_deleted_worker_pod_is_replaced_without_failed_requests(
    kube: Kube,
    pod_node: RealNode,
    namespaces: dict[str, str],
    operator: dict[str, Any],
    seed: Path,
    record_property: Callable[[str, object], None],
) -> None:
    """Two unified replicas behind the router; one worker pod is deleted under a steady
    stream (2 clients): every request succeeds (the router retries on the other worker),
    the router drops the deleted pod and adds its replacement, which then serves."""
    ns, name = namespaces["failover"], "failover"
    body = example(seed, name, replicas=2)
    assert body["spec"]["unified"]["replicas"] == 2
    try:
        _failover(kube, pod_node, ns, name, body, record_property)
    finally:
        remove(kube, ns, name)


def _failover(
    kube: Kube,
    pod_node: RealNode,
    ns: str,
    name: str,
    body: dict[str, Any],
    record_property: Callable[[str, object], None],
) -> None:
    up = deploy(kube, pod_node, ns, body, workers=2)
    port = up["port"]
    print(f"apply -> first answer {up['first_answer_s']:.1f}s, -> 2 workers {up['all_s']:.1f}s")
    before = {worker_url(p): p for p in pods(kube, ns, name, "unified")}
    assert len(before) == 2 and all(p["spec"]["nodeName"] == NODE for p in before.values())
    assert len({p["status"]["podIP"] for p in before.values()}) == 2  # one address each

    # paced, so the surviving worker leaves CPU for its replacement's start on 2 cores
    stream = Stream(port, clients=2, max_tokens=8, pause_s=0.2)
    try:
        time.sleep(3)
        victim_url, victim = sorted(before.items())[0]
        assert answered_by(port, victim_url) > 0, "the victim took no traffic before"
        deleted = time.monotonic()
        kube.kubectl("delete", "pod", "-n", ns, victim["metadata"]["name"], "--wait=false")
        t_dropped = wait(lambda: victim_url not in router_workers(port), 60,
                         "the router dropped the deleted pod", lambda: diagnose(kube, ns))  # fmt: skip
        t_added = wait(lambda: _healthy_workers(kube, port, ns, name) == 2, 240,
                       "a replacement Ready and healthy in the router", lambda: diagnose(kube, ns))  # fmt: skip
        t_added += t_dropped
        (new_url,) = set(router_workers(port)) - set(before)
        wait(lambda: answered_by(port, new_url) > 0, 30, "the replacement answered a request")
        t_served = time.monotonic() - deleted
        time.sleep(2)
    finally:
        stream.stop()
    failed = stream.failures()
    times = {
        "dropped_s": round(t_dropped, 1),
        "replacement_added_s": round(t_added, 1),
        "replacement_served_s": round(t_served, 1),
        "requests": len(stream.outcomes),
        "failed": len(failed),
    }
    for key, value in times.items():
        record_property(key, value)
    print("worker pod deleted:", json.dumps(times))
    assert stream.outcomes and not failed, "failed requests: " + "; ".join(
        f"at {o.started_s:.1f}s status {o.status}: {o.detail}" for o in failed
    )


def autoscaled(seed: Path) -> dict[str, Any]:
    """A unified role of 1 to 2 replicas, scaling on its waiting requests per replica
    (2 running at most per pod, so 6 clients queue)."""
    body = {
        "apiVersion": "kvflow.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "auto"},
        "spec": {
            "mode": "unified",
            "model": {"source": "embedded", "servedModelName": MODEL},
            "unified": {
                "replicas": 1,
                "maxRunningRequests": 2,
                "extraArgs": WORKER_ARGS,
                "resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "4Gi"}},
                "autoscaling": {
                    "enabled": True,
                    "minReplicas": 1,
                    "maxReplicas": 2,
                    "scaleDownStabilizationSeconds": STABILIZATION_S,
                    "targets": {"queuePerReplica": 1},
                },
            },
            "router": {"policy": "round_robin"},
        },
    }
    return adapt_to_pod_network(body, "pod-network", 1, seed, images=True)


def operator_metric(port: int, name: str) -> float | None:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + "{") and 'deployment="auto"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def autoscaler_view(kube: Kube, operator: dict[str, Any]) -> str:
    """The operator's autoscaler series for `auto` and its log tail: what the rule read
    (signals, Ready vs reporting pods) and any scrape it failed, put first so that a
    failure's report shows them even when the rest is cut."""
    try:
        text = httpx.get(f"http://127.0.0.1:{operator['metrics_port']}/metrics", timeout=5).text
        series = [
            line for line in text.splitlines()
            if line.startswith("kvflow_autoscaler_") and 'deployment="auto"' in line
        ]  # fmt: skip
    except httpx.HTTPError as exc:
        series = [f"operator /metrics: {exc}"]
    logs = kube.kubectl(
        "logs", "-n", operator["namespace"], operator["pod"], "--tail=30", check=False, timeout=20
    )
    return "\n".join(["--- autoscaler series", *series, "--- operator log", logs.stdout[-3000:]])


def autoscaling_status(kube: Kube, ns: str) -> dict[str, Any]:
    body = kube.get_json("md", "auto", "-n", ns)
    roles = (body.get("status") or {}).get("roles") or {}
    return dict(roles.get("unified", {}).get("autoscaling", {}))


def deployment_replicas(kube: Kube, ns: str) -> int:
    return int(kube.get_json("deployment", "auto-unified", "-n", ns)["spec"]["replicas"])


def test_autoscaler_scales_out_under_load_and_back_in(
    kube: Kube,
    pod_node: RealNode,
    namespaces: dict[str, str],
    operator: dict[str, Any],
    seed: Path,
    record_property: Callable[[str, object], None],
) -> None:
    """Load makes the role scale out within the documented time, the new replica joins
    the router and answers requests; when the load ends the role scales back in after
    the stabilization window while a light stream goes on; no request fails."""
    ns = namespaces["autoscale"]
    try:
        _autoscale(kube, pod_node, ns, operator, seed, record_property)
    finally:
        remove(kube, ns, "auto")


def _autoscale(
    kube: Kube,
    pod_node: RealNode,
    ns: str,
    operator: dict[str, Any],
    seed: Path,
    record_property: Callable[[str, object], None],
) -> None:
    up = deploy(kube, pod_node, ns, autoscaled(seed), workers=1)
    port = up["port"]
    metrics = operator["metrics_port"]
    why = lambda: autoscaler_view(kube, operator) + "\n" + diagnose(kube, ns)  # noqa: E731
    # the operator pod scrapes the worker at its pod address
    wait(lambda: operator_metric(metrics, "kvflow_autoscaler_reporting_pods") == 1, 60,
         "the operator's collector reads the worker pod", why)  # fmt: skip
    assert deployment_replicas(kube, ns) == 1
    (first,) = pods(kube, ns, "auto", "unified")

    heavy = Stream(port, clients=6, max_tokens=24)
    light: Stream | None = None
    try:
        t_decided = wait(lambda: autoscaling_status(kube, ns).get("desiredReplicas", 1) >= 2,
                         120, "scale-out decided", why)  # fmt: skip
        t_added = t_decided + wait(lambda: _healthy_workers(kube, port, ns, "auto") == 2, 180,
                                   "the new replica Ready and in the router", why)  # fmt: skip
        (new_url,) = set(router_workers(port)) - {worker_url(first)}
        t_served = t_added + wait(lambda: answered_by(port, new_url) > 0, 30,
                                  "the new replica answered through the router")  # fmt: skip
        entry = autoscaling_status(kube, ns)
        assert entry["lastScale"]["direction"] == "up", entry
        assert "queue" in entry["lastScale"]["reason"], entry
        light = Stream(port, clients=1, max_tokens=8)
    finally:
        t_stop = heavy.stop()
    try:
        wait(lambda: autoscaling_status(kube, ns)["desiredReplicas"] == 1,
             STABILIZATION_S + 120, "scale-in decided", why)  # fmt: skip
        t_in = time.monotonic() - t_stop
        wait(lambda: _healthy_workers(kube, port, ns, "auto") == 1, 120,
             "the removed replica gone from the router", why)  # fmt: skip
        t_gone = time.monotonic() - t_stop
        time.sleep(2)
    finally:
        if light is not None:
            light.stop()
    assert light is not None
    entry = autoscaling_status(kube, ns)
    assert entry["lastScale"]["direction"] == "down", entry
    assert deployment_replicas(kube, ns) == 1
    events = kube.get_json("events", "-n", ns, "--field-selector", "involvedObject.name=auto")
    reasons = {e["reason"] for e in events["items"]}
    assert {"ScaledOut", "ScaledIn"} <= reasons, reasons

    created = [
        e["message"]
        for e in kube.get_json("events", "-n", ns)["items"]
        if e["reason"] == "SuccessfulCreate"
        and e["involvedObject"]["name"].startswith("auto-unified-")
    ]
    print(f"worker pods created: {created}")
    outcomes = heavy.outcomes + light.outcomes
    failed = heavy.failures() + light.failures()
    times = {
        "scale_out_decided_s": round(t_decided, 1),
        "scale_out_in_router_s": round(t_added, 1),
        "scale_out_served_s": round(t_served, 1),
        "scale_in_decided_s_after_load": round(t_in, 1),
        "scale_in_out_of_router_s_after_load": round(t_gone, 1),
        "requests": len(outcomes),
        "failed": len(failed),
    }
    for key, value in times.items():
        record_property(key, value)
    print("autoscaler on the pod network:", json.dumps(times))
    assert not failed, "failed requests: " + "; ".join(
        f"at {o.started_s:.1f}s status {o.status}: {o.detail}" for o in failed
    )
    assert t_decided <= SCALE_OUT_BOUND_S, (t_decided, SCALE_OUT_BOUND_S)
    assert t_in >= STABILIZATION_S, t_in  # not before the window


# --- a model over two pods (LeaderWorkerSet, TP=2 over gloo) ---------------------------

TP_NAME = "tp2"
TP_MAX_NEW = 12
TP_PROMPTS = ([5, 6, 7, 8], list(range(100, 141)))


@pytest.fixture(scope="module")
def tiny_llama(
    tmp_path_factory: pytest.TempPathFactory, seed: Path
) -> tuple[Path, dict[tuple[int, ...], list[int]]]:
    """A random-weight Llama (4 heads, 2 KV heads: one per rank at TP 2) with the embedded
    model's tokenizer, in a folder the pods mount; and transformers' greedy output for
    `TP_PROMPTS`, the reference."""
    from tiny_llama import hf_greedy, save_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-llama")
    hf = save_tiny_llama(folder)
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    for name in tokenizer_files:
        shutil.copyfile(seed / "models" / MODEL / name, folder / name)
    for path in [folder, *folder.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    greedy = {tuple(ids): hf_greedy(hf, list(ids), TP_MAX_NEW) for ids in TP_PROMPTS}
    return folder, greedy


def over_two_pods(folder: Path, seed: Path) -> dict[str, Any]:
    """One group of two CPU pods (`nodesPerReplica: 2`, `gpus: 0`: `--tp-size 2 --nnodes
    2`), the model from a host folder, behind the router."""
    body = {
        "apiVersion": "kvflow.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": TP_NAME},
        "spec": {
            "mode": "unified",
            "model": {"source": "hostPath", "hostPath": {"path": str(folder)}},
            "unified": {
                "replicas": 1,
                "gpus": 0,
                "nodesPerReplica": 2,
                "extraArgs": ["--dtype", "float32", "--max-total-tokens", "2048"],
                "resources": {"requests": {"memory": "512Mi"}, "limits": {"memory": "3Gi"}},
            },
            "router": {"policy": "round_robin"},
        },
    }
    return adapt_to_pod_network(body, "pod-network", 1, seed, images=True)


def generate(port: int, ids: list[int]) -> list[int]:
    """Greedy output ids of `ids` through the router (raises unless 200)."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": TP_MAX_NEW}}
    reply = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
    reply.raise_for_status()
    return list(reply.json()["output_ids"])


def group_pods(kube: Kube, ns: str) -> dict[str, dict[str, Any]]:
    """The group's live pods by `kvflow.dev/node` (leader, worker)."""
    return {
        p["metadata"]["labels"]["kvflow.dev/node"]: p for p in pods(kube, ns, TP_NAME, "unified")
    }


def group_serves(kube: Kube, port: int, ns: str) -> dict[str, dict[str, Any]] | None:
    """The group's pods once both run and the leader is Ready and answers a request
    through the router; else None."""
    group = group_pods(kube, ns)
    if set(group) != {"leader", "worker"} or not is_ready(group["leader"]):
        return None
    generate(port, TP_PROMPTS[0])
    return group


def test_a_model_over_two_pods_serves_as_one_and_comes_back_after_a_pod_dies(
    kube: Kube,
    pod_node: RealNode,
    lws: LwsController,
    namespaces: dict[str, str],
    operator: dict[str, Any],
    seed: Path,
    tiny_llama: tuple[Path, dict[tuple[int, ...], list[int]]],
    record_property: Callable[[str, object], None],
) -> None:
    """`nodesPerReplica: 2` on the pod network: LeaderWorkerSet's controller makes a leader
    and a worker pod; the worker finds the leader by its DNS name (`LWS_LEADER_ADDRESS`,
    answered by the node's CoreDNS) and the two run one TP=2 group over gloo; greedy output
    through the router equals transformers. Deleting the worker pod recreates the group
    (`RecreateGroupOnPodRestart`), which serves the same output again."""
    ns = namespaces["lws"]
    folder, greedy = tiny_llama
    why = lambda: diagnose(kube, ns) + "\n--- lws-controller\n" + lws.log_tail(20)  # noqa: E731
    body = over_two_pods(folder, seed)
    started = time.monotonic()
    kube.apply({**body, "metadata": {**body["metadata"], "namespace": ns}})
    try:
        wait(lambda: router_pod_ip(kube, ns), 180, "the router pod's address", why)
        port = pod_node.forward(str(router_pod_ip(kube, ns)), PORT)
        wait(lambda: group_serves(kube, port, ns), 360, "the group serving", why)
        t_up = time.monotonic() - started
        group = group_pods(kube, ns)
        leader, worker = group["leader"], group["worker"]
        assert leader["spec"]["nodeName"] == worker["spec"]["nodeName"] == NODE
        assert leader["status"]["podIP"] != worker["status"]["podIP"]
        env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
        assert env["LWS_WORKER_INDEX"] == "1"
        assert env["LWS_LEADER_ADDRESS"].startswith(leader["metadata"]["name"] + "."), env
        for ids in TP_PROMPTS:
            assert generate(port, list(ids)) == greedy[tuple(ids)]
        leader_port = pod_node.forward(leader["status"]["podIP"], PORT)
        info = httpx.get(f"http://127.0.0.1:{leader_port}/get_server_info", timeout=10).json()
        assert (info["tp_size"], info["engine"]["nnodes"]) == (2, 2), info

        deleted = time.monotonic()
        kube.kubectl("delete", "pod", "-n", ns, worker["metadata"]["name"], "--wait=false")
        uids = {leader["metadata"]["uid"], worker["metadata"]["uid"]}

        def recreated_and_serving() -> bool:
            group = group_serves(kube, port, ns)
            return group is not None and not uids & {p["metadata"]["uid"] for p in group.values()}

        t_back = wait(recreated_and_serving, 360, "the group recreated and serving", why)
        for ids in TP_PROMPTS:
            assert generate(port, list(ids)) == greedy[tuple(ids)]
        times = {"group_serving_s": round(t_up, 1), "group_back_s": round(t_back, 1)}
        for key, value in times.items():
            record_property(key, value)
        print("a model over two pods:", json.dumps(times), f"(deleted at {deleted - started:.1f}s)")
    finally:
        remove(kube, ns, TP_NAME)


def router_pod_ip(kube: Kube, ns: str) -> str | None:
    listed = pods(kube, ns, TP_NAME, "router")
    return listed[0]["status"].get("podIP") if listed else None
