"""KubeDiscovery's list/watch loop against a scripted pod source: relist on 410 Gone and on
errors, resume after a watch ends, events applied on the event loop, stop. The real API
server is exercised in e2e/test_router_discovery.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from discovery_testing import RecordingSink, pod

from kvflow.runtime.router.discovery import KubeDiscovery, WorkerSpec
from kvflow.runtime.router.discovery.kube import SERVICE_ACCOUNT_NAMESPACE, discovery_namespace
from kvflow.runtime.router.discovery.kube_client import WatchExpired, kube_pod_source

Step = list[dict[str, Any]] | Exception


class ScriptedSource:
    """A PodSource that plays lists and watches in order, then blocks until interrupted."""

    def __init__(self, lists: list[tuple[list[dict[str, Any]], str]], watches: list[Step]):
        self.lists, self.watches = list(lists), list(watches)
        self.listed_after: list[str] = []  # the version each watch started from
        self.interrupted = threading.Event()
        self.closed = False

    def list(self) -> tuple[list[dict[str, Any]], str]:
        if not self.lists:
            self.interrupted.wait()
            raise ConnectionError("interrupted")
        return self.lists.pop(0)

    def watch(self, resource_version: str) -> Iterator[dict[str, Any]]:
        self.listed_after.append(resource_version)
        if not self.watches:
            self.interrupted.wait()
            raise ConnectionError("interrupted")
        step = self.watches.pop(0)
        if isinstance(step, Exception):
            raise step
        yield from step

    def interrupt(self) -> None:
        self.interrupted.set()

    def close(self) -> None:
        self.closed = True


def event(kind: str, body: dict[str, Any], version: str) -> dict[str, Any]:
    body = {**body, "metadata": {**body.get("metadata", {}), "resourceVersion": version}}
    return {"type": kind, "object": body}


async def until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def url(ip: str) -> str:
    return f"http://{ip}:8100"


def test_list_then_watch_follow_pods_and_relist_after_410_and_errors() -> None:
    a, b, c = (
        pod("a", ip="127.0.0.1"),
        pod("b", ip="127.0.0.2", ready=False),
        pod("c", ip="127.0.0.3"),
    )
    router = pod("r", role="router", ip="127.0.0.9")
    ready_b = pod("b", ip="127.0.0.2")
    source = ScriptedSource(
        lists=[
            ([a, b, router], "10"),
            ([ready_b, c], "30"),
            ([ready_b, c], "35"),
            ([ready_b], "40"),
        ],
        watches=[
            [event("MODIFIED", ready_b, "11"), event("BOOKMARK", {}, "15")],  # server ends it
            [event("DELETED", a, "16"), event("ERROR", {"code": 410, "message": "gone"}, "0")],
            WatchExpired("too old"),  # expiry raised as an HTTP 410
            ConnectionError("apiserver restarting"),  # backoff, then relist drops c
        ],
    )
    sink = RecordingSink()

    async def run() -> None:
        discovery = KubeDiscovery("ns", "kvflow.dev/deployment=md", sink, source=source)
        await discovery.start()
        await until(lambda: len(source.listed_after) == 5)
        await until(lambda: set(sink.workers) == {url("127.0.0.2")})
        assert discovery.relists == 4
        await discovery.stop()

    asyncio.run(run())
    # Watches resume from the last version seen (the bookmark's), then from each relist.
    assert source.listed_after == ["10", "15", "30", "35", "40"]
    assert sink.calls == [
        ("upsert", url("127.0.0.1")),  # first list: a; b not Ready; the router pod ignored
        ("upsert", url("127.0.0.2")),  # b Ready
        ("remove", url("127.0.0.1")),  # a deleted
        ("upsert", url("127.0.0.3")),  # relist after 410 finds c (b unchanged: no call)
        # relist after the raised 410: nothing changed, no call
        ("remove", url("127.0.0.3")),  # relist after the error: c vanished meanwhile
    ]
    assert sink.workers == {url("127.0.0.2"): WorkerSpec(url("127.0.0.2"))}
    assert source.closed


def test_stop_interrupts_a_blocked_watch_and_drops_later_events() -> None:
    source = ScriptedSource(lists=[([pod("a")], "1")], watches=[])
    sink = RecordingSink()

    async def run() -> None:
        discovery = KubeDiscovery("ns", "x=y", sink, source=source)
        await discovery.start()
        await until(lambda: bool(sink.workers))
        await discovery.stop()
        assert source.interrupted.is_set() and source.closed
        calls = list(sink.calls)
        await asyncio.sleep(0.05)
        assert sink.calls == calls

    asyncio.run(run())


def test_client_config_is_in_cluster_only_without_a_kubeconfig(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kubernetes import config

    loaded: list[str | None] = []
    monkeypatch.setattr(
        config, "load_incluster_config", lambda client_configuration: loaded.append("in-cluster")
    )
    monkeypatch.setattr(
        config,
        "load_kube_config",
        lambda config_file, client_configuration: loaded.append(config_file),
    )
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    kube_pod_source("ns", "x=y", None, 5).close()
    kube_pod_source("ns", "x=y", "/tmp/kc", 5).close()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    kube_pod_source("ns", "x=y", None, 5).close()  # $KUBECONFIG, then ~/.kube/config
    assert loaded == ["in-cluster", "/tmp/kc", None]


def test_namespace_is_the_flag_else_the_pods_own_else_default(tmp_path: Path) -> None:
    own = tmp_path / "namespace"  # what Kubernetes mounts at SERVICE_ACCOUNT_NAMESPACE
    own.write_text("team-a\n")
    empty = tmp_path / "empty"
    empty.write_text("")

    def namespace(given: str | None, file: Path) -> str:
        source = ScriptedSource(lists=[], watches=[])
        return KubeDiscovery(
            given, "x=y", RecordingSink(), source=source, service_account_file=file
        ).namespace

    assert namespace("given", own) == "given"
    assert namespace(None, own) == "team-a"
    assert namespace("", own) == "team-a"
    assert namespace(None, tmp_path / "absent") == "default"  # outside a cluster
    assert namespace(None, empty) == "default"
    assert discovery_namespace(None, own) == "team-a"
    in_pod = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    assert str(SERVICE_ACCOUNT_NAMESPACE) == in_pod
