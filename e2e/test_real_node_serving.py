"""The whole product on the real node: `helm install` the chart (the operator runs as a real
pod), `kubectl apply` the unified embedded example adapted to the node, and a chat
completion through the router pod returns text. Killing the worker pod: its Deployment
replaces it, the router drops and re-adds it, and clients see only clean errors while no
worker is there. Honest status: a deployment whose worker exits (a misspelt flag) or that
no node can host (too much memory) turns Degraded with the pod's reason and the runtime's or
the scheduler's own words.

The worker and router pods run the images users run: the operator's default runtime and
router images, built here from images/runtime.Dockerfile (CPU flavour) and
images/router.Dockerfile without a registry (`e2e.images`) and imported into the node's
containerd under those names; nothing of this checkout is mounted into them. (The
operator pod itself still runs from the host base image with this checkout mounted:
e2e/test_operator_image.py runs the built operator image.)

The example differs from a user's only in per-role pod settings: host networking with
loopback ports (the node has no pod network), `imagePullPolicy: Never`, the apiserver's
loopback address for the in-cluster clients (no kube-proxy), the converted embedded model
and the built CPU kernels mounted read-only into the pods' kvflow cache (each pod would
otherwise convert the GGUF first, ~30 s of 2 shared cores), lower CPU requests (the node has 2 cores) and the
real node's selector and toleration. One unified replica: two host-network replicas would
need the same host port on one node.

Times are printed (`pytest -s`): helm install, apply to first answered request (target
<= 60 s), the replacement gap.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.chart_release import install_operator_chart
from e2e.k8s import Kube
from e2e.k8s.ports import free_ports
from e2e.k8s.realnode import RealNode
from e2e.k8s.realnode.product import adapt_model_deployment, operator_chart_values, seed_embedded
from kvflow.operator.spec import DEFAULT_ROUTER_IMAGE, DEFAULT_RUNTIME_IMAGE

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "unified-embedded.yaml"
FIRST_ANSWER_TARGET_S = 60.0


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kvflow cache readable by the pods' user: the converted embedded model and the
    native CPU kernels built for this machine (both made here first if missing)."""
    return seed_embedded(tmp_path_factory.mktemp("seed") / "cache")


@pytest.fixture(scope="module")
def md_ns(kube: Kube, real_node: RealNode, node_images: dict[str, str]) -> Iterator[str]:
    """The namespace the operator watches; the runtime and router images are on the node."""
    name = f"rns-{uuid.uuid4().hex[:8]}"
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator_release(
    kube: Kube, md_ns: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The chart installed with the operator as a pod on the real node."""
    namespace, release = f"kvflow-rn-{uuid.uuid4().hex[:6]}", "kvflow-rn"
    (health_port,) = free_ports(1)
    values = operator_chart_values(kube.kubeconfig, health_port, [md_ns])
    values["driftIntervalSeconds"] = 5
    seconds = install_operator_chart(
        kube, release, namespace, values, tmp_path_factory.mktemp("operator-values")
    )
    print(f"helm install (operator pod running): {seconds:.1f}s")
    yield {"namespace": namespace, "release": release, "health_port": health_port}
    kube.helm("uninstall", release, "-n", namespace, "--wait", check=False)
    kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def adapted_example(kube: Kube, seed: Path) -> tuple[dict[str, Any], int, int]:
    """examples/unified-embedded.yaml adapted to the real node; returns it with the
    router's and the worker's loopback ports."""
    (body,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d["kind"] == "ModelDeployment"]
    router_port, worker_port = free_ports(2)
    adapted = adapt_model_deployment(
        body, kube.kubeconfig, router_port, worker_port, seed, images=True
    )
    return adapted, router_port, worker_port


def chat(port: int, content: str, timeout: float = 60) -> tuple[int, dict[str, Any]]:
    """POST a greedy chat completion to the router; (status, parsed body)."""
    payload = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            return err.code, json.loads(body)
        except ValueError:
            return err.code, {"raw": body.decode(errors="replace")}


def router_workers(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=5) as response:
        listed = json.loads(response.read())
    items = listed.get("workers", listed) if isinstance(listed, dict) else listed
    return sorted(w["url"] if isinstance(w, dict) else str(w) for w in items)


@pytest.fixture(scope="module")
def deployment(
    kube: Kube, md_ns: str, operator_release: dict[str, Any], seed: Path
) -> Iterator[dict[str, Any]]:
    body, router_port, worker_port = adapted_example(kube, seed)
    started = time.monotonic()
    kube.apply({**body, "metadata": {**body["metadata"], "namespace": md_ns}})

    def answered() -> dict[str, Any] | None:
        try:
            status, reply = chat(router_port, "What is the capital of France?", timeout=120)
        except OSError:
            return None
        return reply if status == 200 else None

    try:
        reply = kube.wait_for(answered, timeout=300, interval=0.5, what="a chat answer")
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{_diagnose(kube, md_ns)}") from err
    first_answer_s = time.monotonic() - started
    print(f"apply -> first answered request: {first_answer_s:.1f}s (target <= 60s)")
    yield {
        "name": body["metadata"]["name"],
        "router_port": router_port,
        "worker_port": worker_port,
        "first_reply": reply,
        "first_answer_s": first_answer_s,
        "seed": seed,
    }
    kube.kubectl("delete", "md", body["metadata"]["name"], "-n", md_ns, "--wait=false", check=False)


def _diagnose(kube: Kube, ns: str) -> str:
    """What the namespace's pods and ModelDeployments look like, with each pod's log tail."""
    parts = [kube.kubectl("get", "md,deploy,pods", "-n", ns, "-o", "wide", check=False).stdout]
    for md in kube.get_json("md", "-n", ns)["items"]:
        parts.append(yaml.safe_dump(md.get("status", {})))
    for pod in kube.get_json("pods", "-n", ns)["items"]:
        name = pod["metadata"]["name"]
        parts.append(f"--- {name}: {json.dumps(pod['status'].get('containerStatuses'))[:1500]}")
        logs = kube.kubectl("logs", "-n", ns, name, "--tail=30", check=False)
        parts.append(logs.stdout + logs.stderr)
    events = kube.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False)
    parts.append(events.stdout[-3000:])
    return "\n".join(parts)


def test_operator_runs_as_a_pod_on_the_real_node(
    kube: Kube, operator_release: dict[str, Any]
) -> None:
    pods = kube.get_json(
        "pods", "-n", operator_release["namespace"],
        "-l", f"app.kubernetes.io/instance={operator_release['release']}",
    )["items"]  # fmt: skip
    (pod,) = pods
    assert pod["spec"]["nodeName"] == "real-node"
    assert pod["status"]["phase"] == "Running"
    url = f"http://127.0.0.1:{operator_release['health_port']}/healthz"

    def healthy() -> bool:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)

    try:
        kube.wait_for(healthy, timeout=60, what="the operator pod's liveness endpoint")
    except TimeoutError:
        logs = kube.kubectl("logs", "-n", operator_release["namespace"], pod["metadata"]["name"],
                            check=False)  # fmt: skip
        raise AssertionError(
            f"operator not healthy; its log:\n{logs.stdout}{logs.stderr}"
        ) from None


def test_chat_through_the_router_pod(
    kube: Kube, md_ns: str, deployment: dict[str, Any], record_property: Any
) -> None:
    record_property("apply_to_first_answer_s", f"{deployment['first_answer_s']:.1f}")
    text = deployment["first_reply"]["choices"][0]["message"]["content"]
    assert "Paris" in text, text
    pods = kube.get_json("pods", "-n", md_ns, "-l", f"kvflow.dev/deployment={deployment['name']}")
    roles = {}
    images = {}
    for pod in pods["items"]:
        assert pod["spec"]["nodeName"] == "real-node"
        assert pod["spec"]["hostNetwork"] is True
        role = pod["metadata"]["labels"]["kvflow.dev/role"]
        roles[role] = pod["status"]["phase"]
        (images[role],) = [c["image"] for c in pod["spec"]["containers"]]
        # nothing of this machine but the seeded cache (read-only, a hostPath)
        host_paths = [v["hostPath"]["path"] for v in pod["spec"]["volumes"] if "hostPath" in v]
        assert host_paths in ([], [str(deployment["seed"])]), host_paths
    assert roles == {"unified": "Running", "router": "Running"}
    assert images == {"unified": DEFAULT_RUNTIME_IMAGE, "router": DEFAULT_ROUTER_IMAGE}
    assert router_workers(deployment["router_port"]) == [
        f"http://127.0.0.1:{deployment['worker_port']}"
    ]
    # the ModelDeployment reports Ready once its pods are
    body = kube.wait_for(
        lambda: _ready_md(kube, md_ns, deployment["name"]), timeout=60, what="Ready=True"
    )
    assert body is not None and body["status"]["roles"]["unified"]["ready"] == 1
    assert deployment["first_answer_s"] <= FIRST_ANSWER_TARGET_S * 2, "far past the target"


def _ready_md(kube: Kube, ns: str, name: str) -> dict[str, Any] | None:
    body = kube.get_json("md", name, "-n", ns)
    conditions = {c["type"]: c["status"] for c in body.get("status", {}).get("conditions", [])}
    return body if conditions.get("Ready") == "True" else None


def test_killed_worker_is_replaced_and_rejoins(
    kube: Kube, md_ns: str, deployment: dict[str, Any]
) -> None:
    router_port, worker_url = (
        deployment["router_port"],
        f"http://127.0.0.1:{deployment['worker_port']}",
    )
    selector = f"kvflow.dev/deployment={deployment['name']},kvflow.dev/role=unified"
    (old,) = kube.get_json("pods", "-n", md_ns, "-l", selector)["items"]
    killed_at = time.monotonic()
    kube.kubectl("delete", "pod", "-n", md_ns, old["metadata"]["name"], "--wait=false")
    outcomes: list[tuple[float, int, str]] = []
    saw_dropped = False
    deadline = killed_at + 180
    while time.monotonic() < deadline:
        workers = router_workers(router_port)
        saw_dropped = saw_dropped or worker_url not in workers
        status, reply = chat(router_port, "Say hello.", timeout=60)
        detail = "" if status == 200 else json.dumps(reply)[:200]
        outcomes.append((time.monotonic() - killed_at, status, detail))
        if saw_dropped and status == 200:
            break
        time.sleep(0.3)
    gap = [o for o in outcomes if o[1] != 200]
    print(
        f"worker replaced: {len(outcomes)} requests over {outcomes[-1][0]:.1f}s, "
        f"{len(gap)} failed cleanly while no worker was there"
    )
    assert saw_dropped, "the router never dropped the deleted worker"
    assert outcomes[-1][1] == 200, outcomes[-5:]
    # while the worker is gone the router answers at once with a 5xx naming the cause
    for _, status, detail in gap:
        assert status in (502, 503), (status, detail)
        assert "error" in detail
    (new,) = [
        p
        for p in kube.get_json("pods", "-n", md_ns, "-l", selector)["items"]
        if not p["metadata"].get("deletionTimestamp")
    ]
    assert new["metadata"]["name"] != old["metadata"]["name"]
    assert router_workers(router_port) == [worker_url]


# --- honest status: what the operator says when its pods cannot serve -----------------


def _apply_variant(
    kube: Kube, ns: str, seed: Path, name: str, unified: dict[str, Any]
) -> tuple[dict[str, Any], int]:
    """The adapted example renamed `name`, its unified role updated with `unified`;
    applied in `ns`; returns it and its router's port."""
    body, router_port, _ = adapted_example(kube, seed)
    body["metadata"] = {"name": name, "namespace": ns}
    body["spec"]["unified"].update(unified)
    kube.apply(body)
    return body, router_port


def _wait_degraded(kube: Kube, ns: str, name: str, timeout: float) -> dict[str, Any]:
    """The ModelDeployment's conditions by type, once Degraded is True."""

    def degraded() -> dict[str, Any] | None:
        body = kube.get_json("md", name, "-n", ns)
        found = {c["type"]: c for c in body.get("status", {}).get("conditions", [])}
        return found if found.get("Degraded", {}).get("status") == "True" else None

    try:
        found = kube.wait_for(degraded, timeout=timeout, what="Degraded=True")
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{_diagnose(kube, ns)}") from err
    assert found is not None
    return found


def test_a_refused_flag_makes_the_deployment_degraded_with_its_last_words(
    kube: Kube, md_ns: str, operator_release: dict[str, Any], seed: Path
) -> None:
    """A misspelt `kvflow serve` flag in extraArgs passes admission (extraArgs are the
    runtime's to judge) and the container exits 2 on the real kubelet: the ModelDeployment
    turns Degraded within seconds with the pod's reason and the runtime's own error, is not
    Ready, and its router answers clients at once with a 503 naming the cause."""
    name = "refused-flag"
    _, router_port = _apply_variant(
        kube, md_ns, seed, name, {"extraArgs": ["--max-runing-requests", "4"]}
    )
    started = time.monotonic()
    try:
        found = _wait_degraded(kube, md_ns, name, timeout=150)
        print(f"refused flag -> Degraded: {time.monotonic() - started:.1f}s")
        degraded = found["Degraded"]
        assert degraded["reason"] in ("ContainerFailed", "ContainerRestarted", "CrashLoopBackOff")
        assert "exit code 2" in degraded["message"], degraded
        assert "unrecognized arguments: --max-runing-requests 4" in degraded["message"], degraded
        assert found["Ready"]["status"] == "False"
        assert found["UnifiedReady"]["reason"] == degraded["reason"]

        def refused() -> tuple[int, dict[str, Any]] | None:
            try:
                return chat(router_port, "Hello?", timeout=30)
            except OSError:  # the router pod is still starting
                return None

        got = kube.wait_for(refused, timeout=90, interval=0.5, what="the router's answer")
        assert got is not None
        status, reply = got
        assert status == 503, (status, reply)
        assert "worker" in json.dumps(reply), reply
    finally:
        kube.kubectl("delete", "md", name, "-n", md_ns, "--wait=false", check=False)


def test_a_spec_no_node_can_host_is_degraded_unschedulable(
    kube: Kube, md_ns: str, operator_release: dict[str, Any], seed: Path
) -> None:
    """A worker asking for more memory than any node has stays Pending: the operator says
    so (Degraded, reason Unschedulable, the scheduler's own message) rather than waiting
    for the Deployment's progress deadline."""
    name = "too-big"
    resources = {"requests": {"cpu": "250m", "memory": "100Ti"}, "limits": {"memory": "100Ti"}}
    _apply_variant(kube, md_ns, seed, name, {"resources": resources})
    try:
        found = _wait_degraded(kube, md_ns, name, timeout=90)
        degraded = found["Degraded"]
        assert degraded["reason"] == "Unschedulable", degraded
        assert "Insufficient memory" in degraded["message"], degraded
        assert found["UnifiedReady"]["reason"] == "Unschedulable"
        assert found["Ready"]["status"] == "False"
    finally:
        kube.kubectl("delete", "md", name, "-n", md_ns, "--wait=false", check=False)
