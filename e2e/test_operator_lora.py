"""LoRA adapters of a ModelDeployment on the real control plane: an adapter added to
``spec.lora.adapters`` is served by the running pod without a restart, and removed again.

The operator runs as a process (as in test_operator.py); kwok runs the pods, with loopback
pod IPs (127.224.0.0/16), so the worker pod's address reaches a real ``kvflow serve`` on
this machine listening on the pod's port (a tiny random Llama with ``--enable-lora``, as
tests/lora builds it), and the router pod's address a real ``kvflow router`` discovering
the pods through the API with the ServiceAccount the operator rendered for it. Everything
in between is the product's: the operator's pod annotation, the router's discovery, its
loads and unloads on the worker, its routing, and the status the operator reads back from
the router. What kwok cannot show (the kubelet mounting the adapter folder into a real
container) the real-node tests show for the model folder the same way (a hostPath).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.k8s import Kube
from e2e.operator_process import OperatorProcess, service_account_kubeconfig
from e2e.test_operator import crds_and_namespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "server"))
sys.path.insert(0, str(REPO / "tests" / "lora"))

from lora_adapters import ALL_MODULES, build_adapter, build_base, prompts  # noqa: E402
from server_process import ServerProcess, free_port  # noqa: E402

pytestmark = pytest.mark.cluster

NAME = "lora"
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def folders() -> Iterator[dict[str, Path]]:
    root = Path(tempfile.mkdtemp(prefix="kvflow-e2e-lora-", dir="/var/tmp"))
    try:
        base, adapters = root / "base", root / "adapters"
        build_base(base)
        build_adapter(base, adapters / "a", seed=1, r=8, lora_alpha=16, target_modules=ALL_MODULES)
        build_adapter(base, adapters / "b", seed=2, r=4, lora_alpha=8, target_modules=["q_proj"])
        yield {"base": base, "a": adapters / "a", "b": adapters / "b"}
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def ns(kube: Kube) -> Iterator[str]:
    yield from crds_and_namespace(kube, "lora")


@pytest.fixture(scope="module")
def worker(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The real server behind the worker pod's address (every interface of this machine's
    loopback: the pod IP is 127.224.x.y)."""
    proc = ServerProcess(
        "--host", "0.0.0.0", "--model-path", str(folders["base"]), "--skip-tokenizer-init",
        "--dtype", "float32", "--enable-lora", "--max-loras-per-batch", "2",
        "--max-lora-rank", "8", "--lora-target-modules", "all",
        log=tmp_path_factory.mktemp("lora-worker") / "worker.log",
    )  # fmt: skip
    yield proc
    proc.stop()


def _free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        return int(sock.getsockname()[1])


def _spec(folders: dict[str, Path], worker_port: int, router_port: int, names: list[str]):
    adapters = [
        {"name": n, "source": "hostPath", "hostPath": {"path": str(folders[n])}} for n in names
    ]
    return {
        "apiVersion": "kvflow.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "unified": {"replicas": 1, "ports": {"http": worker_port}},
            "router": {"ports": {"http": router_port}},
            "lora": {"maxLorasPerBatch": 2, "maxLoraRank": 8, "adapters": adapters},
        },
    }


def _router(kube: Kube, ns: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    """``kvflow router`` as the router pod runs it, with the operator-rendered
    ServiceAccount's token (its Role: read pods)."""
    account = f"{NAME}-router"
    kube.wait_for(lambda: kube.get_json("serviceaccount", account, "-n", ns), 60, 0.5, account)
    token = kube.kubectl("create", "token", account, "-n", ns).stdout.strip()
    admin = json.loads(kube.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
    kubeconfig = service_account_kubeconfig(admin, token, log.with_suffix(".kubeconfig"))
    selector = f"kvflow.dev/deployment={NAME},kvflow.dev/role in (unified)"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
    env.pop("KVFLOW_API_KEY", None)
    argv = [sys.executable, "-P", "-m", "kvflow", "router", "--host", "0.0.0.0", "--port",
            str(port), "--discover-namespace", ns, "--discover-selector", selector,
            "--health-interval-s", "0.5"]  # fmt: skip
    return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _adapters_of(url: str) -> set[str]:
    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return {m["id"] for m in models if m.get("parent")}


def _generate(url: str, ids: list[int], lora_path: str | None) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": GREEDY, "lora_path": lora_path}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def _worker_pod(kube: Kube, ns: str) -> dict[str, Any]:
    items = kube.get_json(
        "pods", "-n", ns, "-l", f"kvflow.dev/deployment={NAME},kvflow.dev/role=unified"
    )
    (pod,) = [p for p in items["items"] if not p["metadata"].get("deletionTimestamp")]
    return pod


def _lora_status(kube: Kube, ns: str) -> dict[str, str] | None:
    roles = (kube.get_json("md", NAME, "-n", ns).get("status") or {}).get("roles") or {}
    return (roles.get("unified") or {}).get("loraAdapters")


def test_adapter_added_then_removed_on_the_running_pod(
    kube: Kube, ns: str, folders: dict[str, Path], worker: Any, tmp_path: Path
) -> None:
    router_port = _free_tcp_port()
    operator = OperatorProcess(kube.env, [ns], tmp_path / "operator.log", drift_interval=3.0)
    operator.start()
    router = None
    try:
        started = time.monotonic()
        kube.apply({**_spec(folders, worker.port, router_port, ["a"]),
                    "metadata": {"name": NAME, "namespace": ns}})  # fmt: skip
        router = _router(kube, ns, router_port, tmp_path / "router.log")
        router_url = f"http://127.0.0.1:{router_port}"
        kube.wait_for(lambda: _adapters_of(worker.url) == {"a"}, 90, 0.3, "a loaded by the router")
        print(f"apply -> adapter a loaded on the worker: {time.monotonic() - started:.1f}s")
        ids = prompts((10,))[0]
        direct = _generate(worker.url, ids, "a").json()["output_ids"]
        served = kube.wait_for(
            lambda: _generate(router_url, ids, "a") if router.poll() is None else None,
            30, 0.3, "the router serving a",
        )  # fmt: skip
        assert served.status_code == 200 and served.json()["output_ids"] == direct, served.text
        pod = _worker_pod(kube, ns)
        deployment = kube.get_json("deployment", f"{NAME}-unified", "-n", ns)
        assert "a=" in pod["metadata"]["annotations"]["kvflow.dev/lora-adapters"]

        # add b (next to a): loaded on the same pod and served, nothing restarted
        added = time.monotonic()
        kube.apply({**_spec(folders, worker.port, router_port, ["a", "b"]),
                    "metadata": {"name": NAME, "namespace": ns}})  # fmt: skip
        kube.wait_for(lambda: _adapters_of(worker.url) == {"a", "b"}, 60, 0.3, "b loaded")
        print(f"adapter b added -> loaded: {time.monotonic() - added:.1f}s")
        body = {"model": "base:b", "prompt": ids, "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{router_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert _worker_pod(kube, ns)["metadata"]["uid"] == pod["metadata"]["uid"]
        now = kube.get_json("deployment", f"{NAME}-unified", "-n", ns)
        # the same pod template (a Deployment's generation also moves with its annotations,
        # which carry the ModelDeployment's generation), so no new ReplicaSet, no new pod
        assert now["spec"]["template"] == deployment["spec"]["template"]
        replica_sets = kube.get_json("replicasets", "-n", ns, "-l", "kvflow.dev/role=unified")
        assert len(replica_sets["items"]) == 1
        assert worker.proc.poll() is None  # the same server process throughout
        kube.wait_for(
            lambda: _lora_status(kube, ns) == {"a": "1/1", "b": "1/1"}, 60, 0.5, "status a, b"
        )

        # remove a: unloaded from the running pod; a request for it is the router's 400
        kube.apply({**_spec(folders, worker.port, router_port, ["b"]),
                    "metadata": {"name": NAME, "namespace": ns}})  # fmt: skip
        kube.wait_for(lambda: _adapters_of(worker.url) == {"b"}, 60, 0.3, "a unloaded")
        refused = kube.wait_for(
            lambda: (r := _generate(router_url, ids, "a")).status_code == 400 and r, 30, 0.3,
            "a refused",
        )  # fmt: skip
        assert "unknown LoRA adapter 'a'" in refused.text
        assert _generate(router_url, ids, "b").status_code == 200
        assert _worker_pod(kube, ns)["metadata"]["uid"] == pod["metadata"]["uid"]
        kube.wait_for(lambda: _lora_status(kube, ns) == {"b": "1/1"}, 60, 0.5, "status b")
    finally:
        if router is not None:
            router.terminate()
            router.wait(20)
        kube.kubectl("delete", "md", NAME, "-n", ns, "--wait=false", check=False)
        operator.stop()


def test_admission_refuses_bad_adapter_lists(kube: Kube, ns: str, folders: dict[str, Path]) -> None:
    """The CRD's own rules, at the API server: a name twice, a bad name, adapters in
    extraArgs, a host folder at the root."""
    port = free_port()
    body = _spec(folders, port, port + 1, ["a"])
    body["metadata"] = {"name": "bad", "namespace": ns}
    cases = []
    twice = json.loads(json.dumps(body))
    twice["spec"]["lora"]["adapters"] *= 2
    cases.append((twice, "Duplicate value"))
    named = json.loads(json.dumps(body))
    named["spec"]["lora"]["adapters"][0]["name"] = "base:a"
    cases.append((named, "spec.lora.adapters[0].name"))
    listed = json.loads(json.dumps(body))  # adapters come from spec.lora: the router loads them
    listed["spec"]["unified"]["extraArgs"] = ["--lora-paths", "b=/models/b"]
    cases.append((listed, "--lora-paths: use spec.lora"))
    rooted = json.loads(json.dumps(body))
    rooted["spec"]["lora"]["adapters"][0]["hostPath"]["path"] = "/a"
    cases.append((rooted, "its parent is mounted into the pods"))
    for manifest, words in cases:
        result = kube.kubectl("apply", "-f", "-", input=json.dumps(manifest), check=False)
        assert result.returncode != 0, manifest
        assert words in result.stderr, result.stderr
