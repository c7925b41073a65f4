"""The router's Kubernetes discovery against the real control plane, with the Role the
operator renders for it: pods appear once Ready, leave when they lose readiness or are
deleted, and the worker set follows. kwok runs the pods (loopback pod IPs; no traffic is
sent, the sink only records)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from e2e.k8s import Kube
from e2e.operator_process import service_account_kubeconfig
from kvflow import contract
from kvflow.operator import parse_model_deployment
from kvflow.operator.names import child_name
from kvflow.operator.workloads import router_access
from kvflow.runtime.router.discovery import KubeDiscovery, WorkerSpec

pytestmark = pytest.mark.cluster

T = TypeVar("T")
DEPLOYMENT = "disc"
SELECTOR = f"kvflow.dev/deployment={DEPLOYMENT}"  # router pods match too: the role rules them out
WATCH_TIMEOUT_SECONDS = 2  # short, so the test spans several re-watches


class RecordingSink:
    """A WorkerSink keeping the worker set; called on the loop thread only."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerSpec] = {}
        self.removed: list[str] = []

    def upsert(self, spec: WorkerSpec) -> None:
        self.workers[spec.url] = spec

    def remove(self, url: str) -> None:
        self.removed.append(url)
        del self.workers[url]


class RunningDiscovery:
    """KubeDiscovery on an event loop in a thread of its own, as the router runs it."""

    def __init__(self, discovery: KubeDiscovery, sink: RecordingSink) -> None:
        self.discovery, self.sink = discovery, sink
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> RunningDiscovery:
        self._thread.start()
        self.run(self.discovery.start())
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.run(self.discovery.stop())  # again if the test stopped it: a no-op
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def workers(self) -> dict[str, WorkerSpec]:
        """The sink's worker set, read on the loop (the sink's thread)."""

        async def snapshot() -> dict[str, WorkerSpec]:
            return dict(self.sink.workers)

        return self.run(snapshot())


def worker_pod(namespace: str, name: str, role: str, **extra_spec: Any) -> dict[str, Any]:
    ports = [{"name": contract.API_PORT_NAME, "containerPort": contract.DEFAULT_API_PORT}]
    annotations = {}
    if role == "prefill":
        ports.append({"name": contract.BOOTSTRAP_PORT_NAME, "containerPort": 9000})
        annotations[contract.BOOTSTRAP_PORT_ANNOTATION] = "9000"
    container = {
        "name": "runtime",
        "image": "registry.invalid/kvflow/never-pulled:0",  # kwok runs no containers
        "ports": ports,
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kvflow.dev/deployment": DEPLOYMENT, contract.ROLE_LABEL: role},
            "annotations": annotations,
        },
        "spec": {"containers": [container], "automountServiceAccountToken": False, **extra_spec},
    }


def router_kubeconfig(kube: Kube, namespace: str, path: Path) -> Path:
    """A kubeconfig holding the token of the router's ServiceAccount, bound to the Role the
    operator renders (owner references dropped: no ModelDeployment owns them here)."""
    body = {
        "apiVersion": "kvflow.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": DEPLOYMENT, "namespace": namespace, "uid": "u", "generation": 1},
        "spec": {"model": {"source": "embedded"}},
    }
    access = router_access(parse_model_deployment(body))
    for manifest in access:
        del manifest["metadata"]["ownerReferences"]
    kube.apply(access)
    account = child_name(DEPLOYMENT, "router")
    token = kube.kubectl("create", "token", account, "-n", namespace).stdout.strip()
    admin = json.loads(kube.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
    return service_account_kubeconfig(admin, token, path)


def test_discovery_follows_pod_readiness_and_deletion(
    kube: Kube, kube_namespace: str, tmp_path: Path
) -> None:
    ns = kube_namespace
    kubeconfig = router_kubeconfig(kube, ns, tmp_path / "router.kubeconfig")
    kube.wait_for(lambda: kube.get_json("serviceaccount", "default", "-n", ns), 60, 0.5)
    sink = RecordingSink()

    def set_ready(name: str, ready: bool) -> None:
        status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        kube.kubectl(
            "patch", "pod", name, "-n", ns, "--subresource=status", "--type=strategic",
            "-p", json.dumps({"status": status}),
        )  # fmt: skip

    def url_of(name: str) -> str:
        ip = kube.get_json("pod", name, "-n", ns)["status"]["podIP"]
        return f"http://{ip}:{contract.DEFAULT_API_PORT}"

    discovery = KubeDiscovery(
        ns, SELECTOR, sink, kubeconfig=str(kubeconfig), watch_timeout_seconds=WATCH_TIMEOUT_SECONDS
    )
    with RunningDiscovery(discovery, sink) as running:
        workers = running.workers
        kube.apply(
            [
                worker_pod(ns, "unified-0", "unified"),
                worker_pod(ns, "prefill-0", "prefill"),
                worker_pod(ns, "router-0", "router"),
                # Never scheduled, so never Ready nor given an IP.
                worker_pod(ns, "pending-0", "decode", nodeSelector={"kvflow.dev/no-such": "node"}),
            ]
        )
        unified, prefill = kube.wait_for(
            lambda: (url_of("unified-0"), url_of("prefill-0")), 60, 0.5, "pod IPs"
        )
        expected = {
            unified: WorkerSpec(unified, "unified"),
            prefill: WorkerSpec(prefill, "prefill", 9000),
        }
        kube.wait_for(lambda: workers() == expected, 60, 0.2, "both workers discovered")

        set_ready("unified-0", False)
        kube.wait_for(lambda: unified not in workers(), 30, 0.2, "unready pod dropped")
        set_ready("unified-0", True)
        kube.wait_for(lambda: workers() == expected, 30, 0.2, "ready again, back")

        kube.kubectl("delete", "pod", "prefill-0", "-n", ns, "--wait=false")
        kube.wait_for(lambda: prefill not in workers(), 30, 0.2, "deleted pod dropped")
        kube.wait_for(
            lambda: "prefill-0" not in kube.kubectl("get", "pods", "-n", ns, "-o", "name").stdout,
            60, 0.5, "prefill-0 gone",
        )  # fmt: skip
        # The server ends each watch after WATCH_TIMEOUT_SECONDS; each resumes where it
        # stopped (no relist) and misses nothing: the next pod still joins.
        kube.wait_for(lambda: discovery.watches >= 3, 60, 0.5, "two watches resumed")
        assert discovery.relists == 1
        added_late = worker_pod(ns, "unified-1", "unified")
        kube.apply(added_late)
        late = kube.wait_for(lambda: url_of("unified-1"), 60, 0.5, "unified-1's IP")
        kube.wait_for(lambda: late in workers(), 30, 0.2, "a pod created later joins")
        running.run(discovery.stop())
        assert set(workers()) == {unified, late}
        assert sink.removed == [unified, prefill]


def test_stop_interrupts_a_long_watch(kube: Kube, kube_namespace: str, tmp_path: Path) -> None:
    kubeconfig = router_kubeconfig(kube, kube_namespace, tmp_path / "router.kubeconfig")
    sink = RecordingSink()
    discovery = KubeDiscovery(
        kube_namespace, SELECTOR, sink, kubeconfig=str(kubeconfig), watch_timeout_seconds=600
    )
    with RunningDiscovery(discovery, sink) as running:
        kube.wait_for(lambda: discovery.watches == 1, 60, 0.2, "the watch to start")
        running.run(discovery.stop())  # joins for at most 5 s; the watch would run 600 s
        assert not discovery.running
