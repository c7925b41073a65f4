# ruff: noqa: F811  (the imported fixtures are requested as arguments of the same names)
"""Prefill/decode disaggregation with HiCache on the real node: `helm install` the chart
(the operator runs as a pod), `kubectl apply` the disaggregated + HiCache example adapted
to the node, and a greedy chat completion goes router -> prefill -> decode with the
Mooncake master pod running; its answer equals a unified `kvflow serve`'s.

The example differs from a user's only in per-role pod settings (as in
test_real_node_serving.py): every role on the host network with a loopback port of its
own (prefill HTTP and bootstrap, decode, router, the master's three ports), the master
reached at 127.0.0.1 (`mooncakeMaster.host`: Services get no endpoints for loopback pods),
`imagePullPolicy: Never` (every role runs the operator's default runtime or router image,
built here from images/ and imported into the node, nothing of this checkout mounted;
`e2e.images`), the seeded kvflow cache, lower CPU
requests and the real node's selector and toleration. One decode replica instead of
two: two host-network replicas of one role would need one host port twice on one node.

Times are printed (`pytest -s`): apply -> first answered request.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.k8s import Kube
from e2e.k8s.ports import free_ports
from e2e.k8s.realnode.hostpods import api_server_env, real_node_placement
from e2e.k8s.realnode.product import SEEDED_CACHE

# Module-scoped fixtures shared with the unified real-node test (one instance per module):
# the seeded cache, the namespace the operator watches, the chart's operator pod.
from e2e.test_real_node_serving import (  # noqa: F401
    _diagnose,
    _ready_md,
    md_ns,
    operator_release,
    seed,
)
from kvflow.operator.spec import DEFAULT_ROUTER_IMAGE, DEFAULT_RUNTIME_IMAGE

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "disaggregated-hicache.yaml"
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Write a short story about a lighthouse keeper."
MAX_TOKENS = 24  # no EOS before it: every token is compared
FIRST_ANSWER_BUDGET_S = 420.0  # a bound on a loaded 2-core machine; the time is printed
# Where the operator mounts the runtime pods' writable cache (kvflow.operator.paths).
POD_CACHE_DIR = "/var/cache/kvflow"


def example_documents() -> tuple[dict[str, Any], dict[str, Any]]:
    """The example's API key Secret and its ModelDeployment."""
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    (body,) = [d for d in docs if d["kind"] == "ModelDeployment"]
    return secret, body


def _pod_settings(seed: Path | None, extra_env: list[dict[str, Any]]) -> dict[str, Any]:
    """A role's pod settings on the real node: the role's default image (no `image`), the
    seed cache mounted read-only where the runtime looks for it."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if seed is not None:
        volumes.append({"name": "seed", "hostPath": {"path": str(seed), "type": "Directory"}})
        mounts += [
            {
                "name": "seed",
                "mountPath": f"{POD_CACHE_DIR}/{sub}",
                "subPath": sub,
                "readOnly": True,
            }
            for sub in SEEDED_CACHE
            if (seed / sub).is_dir()
        ]
    return {
        "hostNetwork": True,
        "volumes": volumes,
        "volumeMounts": mounts,
        "env": list(extra_env),
        **real_node_placement(),
    }


def adapt_disaggregated(
    body: dict[str, Any], kubeconfig: Path, ports: dict[str, int], seed: Path
) -> dict[str, Any]:
    """A copy of the disaggregated example that runs on the host-network real node, each
    role on its loopback port from ``ports`` (router, prefill, bootstrap, decode, rpc,
    metadata, metrics)."""
    out = copy.deepcopy(body)
    spec = out["spec"]
    assert spec["mode"] == "disaggregated" and spec["hiCache"]["sharedStore"]["type"] == "mooncake"
    spec["imagePullPolicy"] = "Never"
    for role in ("prefill", "decode"):
        worker = spec[role]
        worker.update(replicas=1, ports={"http": ports[role]}, **_pod_settings(seed, []))
        worker["resources"]["requests"]["cpu"] = "250m"
    spec["kvTransfer"]["bootstrapPort"] = ports["bootstrap"]
    router = spec["router"]
    router.update(ports={"http": ports["router"]}, **_pod_settings(None, []))
    router["env"] += api_server_env(kubeconfig)
    router["resources"] = {"requests": {"cpu": "50m", "memory": "128Mi"}}
    spec["mooncakeMaster"] = {
        "host": "127.0.0.1",
        "ports": {name: ports[name] for name in ("rpc", "metadata", "metrics")},
        **_pod_settings(None, []),
    }
    return out


def post(
    url: str, payload: dict[str, Any], api_key: str, timeout: float = 120
) -> tuple[int, dict[str, Any]]:
    """POST JSON with the bearer key; (status, parsed body)."""
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
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


def greedy_chat(base_url: str, api_key: str, timeout: float = 120) -> tuple[int, dict[str, Any]]:
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    return post(f"{base_url}/v1/chat/completions", payload, api_key, timeout)


def metric(port: int, name: str, labels: str = "") -> float:
    """Sum of one Prometheus series family on a worker's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def listening() -> dict[int, set[str]]:
    """TCP ports listened on in this network namespace (the host-network pods' too), with
    the addresses each is bound to."""
    out: dict[int, set[str]] = {}
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            host = ipaddress.ip_address(words[:size])
            out.setdefault(int(port, 16), set()).add(str(host))
    return out


@pytest.fixture(scope="module")
def pd_deployment(
    kube: Kube, md_ns: str, operator_release: dict[str, Any], seed: Path
) -> Iterator[dict[str, Any]]:
    secret, body = example_documents()
    keys = ("router", "prefill", "bootstrap", "decode", "rpc", "metadata", "metrics")
    ports = dict(zip(keys, free_ports(len(keys)), strict=True))
    adapted = adapt_disaggregated(body, kube.kubeconfig, ports, seed)
    name, api_key = adapted["metadata"]["name"], secret["stringData"]["api-key"]
    before = listening()
    started = time.monotonic()
    kube.apply(
        [{**doc, "metadata": {**doc["metadata"], "namespace": md_ns}} for doc in (secret, adapted)]
    )

    def answered() -> dict[str, Any] | None:
        try:
            status, reply = greedy_chat(f"http://127.0.0.1:{ports['router']}", api_key)
        except OSError:
            return None
        return reply if status == 200 else None

    try:
        reply = kube.wait_for(
            answered, timeout=FIRST_ANSWER_BUDGET_S, interval=0.5, what="a chat answer"
        )
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{_diagnose(kube, md_ns)}") from err
    first_answer_s = time.monotonic() - started
    print(f"PD + HiCache: apply -> first answered request: {first_answer_s:.1f}s")
    opened = {
        port: hosts - before.get(port, set())
        for port, hosts in listening().items()
        if hosts - before.get(port, set())
    }
    yield {
        "listening": opened,
        "name": name,
        "api_key": api_key,
        "ports": ports,
        "first_reply": reply,
        "first_answer_s": first_answer_s,
    }
    kube.kubectl("delete", "md", name, "-n", md_ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def unified_answer(pd_deployment: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same greedy chat from a unified `kvflow serve` on this machine (loopback, the
    cache the seed came from), started after the PD pods answered."""
    (port,) = free_ports(1)
    log = tmp_path_factory.mktemp("unified") / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["KVFLOW_API_KEY"] = pd_deployment["api_key"]
    argv = [sys.executable, "-P", "-m", "kvflow", "serve", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--served-model-name", MODEL]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + FIRST_ANSWER_BUDGET_S
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                status, reply = greedy_chat(
                    f"http://127.0.0.1:{port}", pd_deployment["api_key"], timeout=60
                )
                if status == 200:
                    return str(reply["choices"][0]["message"]["content"])
            except OSError:
                pass
            time.sleep(0.5)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_chat_goes_router_prefill_decode_with_the_mooncake_master_running(
    kube: Kube, md_ns: str, pd_deployment: dict[str, Any], record_property: Any
) -> None:
    record_property("pd_apply_to_first_answer_s", f"{pd_deployment['first_answer_s']:.1f}")
    ports, api_key = pd_deployment["ports"], pd_deployment["api_key"]
    pods = kube.get_json(
        "pods", "-n", md_ns, "-l", f"kvflow.dev/deployment={pd_deployment['name']}"
    )
    roles = {}
    for pod in pods["items"]:
        assert pod["spec"]["nodeName"] == "real-node" and pod["spec"]["hostNetwork"] is True
        role = pod["metadata"]["labels"]["kvflow.dev/role"]
        roles[role] = pod["status"]["phase"]
        # every container of a pod (the master's has its metadata server beside it) runs
        # the image the chart's defaults name for its role
        images = {c["image"] for c in pod["spec"]["containers"]}
        assert images == {DEFAULT_ROUTER_IMAGE if role == "router" else DEFAULT_RUNTIME_IMAGE}
    assert roles == {
        "prefill": "Running",
        "decode": "Running",
        "router": "Running",
        "mooncake-master": "Running",
    }, roles
    # Every port the spec gives a role is bound on the pod IP (127.0.0.1 here), none on
    # every interface of the node: workers, router, bootstrap server, Mooncake master.
    opened = pd_deployment["listening"]
    for role, port in ports.items():
        assert opened.get(port) == {"127.0.0.1"}, (role, port, opened.get(port))
    others = {p: h for p, h in opened.items() if p not in ports.values()}
    print(f"other listeners opened meanwhile (transfer engines, other suites): {others}")
    # One more request, counted on each side: the prefill computes the prompt's KV and
    # writes it to the decode (bytes on the prefill, none on the decode), the decode
    # generates the tokens.
    sent_before = metric(ports["prefill"], "kvflow:kv_transfer_bytes_total")
    generated_before = metric(ports["decode"], "sglang:generation_tokens_total")
    status, reply = greedy_chat(f"http://127.0.0.1:{ports['router']}", api_key)
    assert status == 200, reply
    assert reply["choices"][0]["message"] == pd_deployment["first_reply"]["choices"][0]["message"]
    completion = reply["usage"]["completion_tokens"]
    kube.wait_for(
        lambda: metric(ports["prefill"], "kvflow:kv_transfer_bytes_total") > sent_before,
        timeout=30,
        what="the prefill's KV transfer counted",
    )
    kube.wait_for(
        lambda: (
            metric(ports["decode"], "sglang:generation_tokens_total")
            >= generated_before + completion
        ),
        timeout=30,
        what="the decode's generated tokens counted",
    )
    assert metric(ports["decode"], "kvflow:kv_transfer_bytes_total") == 0
    # The prefill's HiCache writes through to the Mooncake store the master indexes.
    kube.wait_for(
        lambda: metric(ports["prefill"], "kvflow:hicache_storage_bytes_total", 'op="write"') > 0,
        timeout=60,
        what="HiCache pages written to the Mooncake store",
    )
    assert metric(ports["prefill"], "kvflow:hicache_storage_errors_total") == 0
    body = kube.wait_for(
        lambda: _ready_md(kube, md_ns, pd_deployment["name"]), timeout=60, what="Ready=True"
    )
    assert body is not None


def test_greedy_answer_equals_the_unified_one(
    pd_deployment: dict[str, Any], unified_answer: str
) -> None:
    pd_answer = pd_deployment["first_reply"]["choices"][0]["message"]["content"]
    print(f"PD answer {pd_answer!r}, unified answer {unified_answer!r}")
    assert pd_answer == unified_answer
    assert pd_deployment["first_reply"]["usage"]["completion_tokens"] == MAX_TOKENS
