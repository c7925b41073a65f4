"""The operator, run as a process, against the real control plane with kwok nodes.

One operator watches one namespace for the whole module; the tests run in file order and
each leaves the ModelDeployments Ready for the next. Apply-to-Ready times are printed
(``pytest -rP`` shows them) and recorded as junit properties.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.k8s import Kube
from e2e.operator_process import OperatorProcess
from kvflow.operator import CHILD_KINDS, child_key, parse_model_deployment, render_children
from kvflow.operator.render import OPTIONAL_KINDS

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
UNIFIED = REPO / "examples" / "unified-embedded.yaml"
DISAGGREGATED = REPO / "examples" / "disaggregated-hicache.yaml"
RESOURCE_NAMES = {
    "ConfigMap": "configmaps",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles.rbac.authorization.k8s.io",
    "RoleBinding": "rolebindings.rbac.authorization.k8s.io",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Service": "services",
    "Deployment": "deployments.apps",
    "PodDisruptionBudget": "poddisruptionbudgets.policy",
    "NetworkPolicy": "networkpolicies.networking.k8s.io",
}
# LeaderWorkerSets only where LWS is installed (test_operator_lws.py; these specs have none)
KIND_ARGS = ",".join(RESOURCE_NAMES[k] for v, k in CHILD_KINDS if (v, k) not in OPTIONAL_KINDS)
DRIFT_INTERVAL = 5.0


def wait_established(kube: Kube) -> None:
    """``kubectl wait --for=condition=Established`` fails outright while a just-created
    CRD has no status yet (a race the larger CRD made visible): poll instead."""

    def established() -> bool:
        crd = kube.get_json("crd", "modeldeployments.kvflow.dev")
        conditions = (crd.get("status") or {}).get("conditions") or ()
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    kube.wait_for(established, 30, 0.2, "CRD Established")


def crds_and_namespace(kube: Kube, prefix: str) -> Iterator[str]:
    """The chart's CRDs applied (and established), then a fresh namespace ``prefix-<hex>``
    for a module's tests, deleted after them."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    wait_established(kube)
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def ns(kube: Kube) -> Iterator[str]:
    yield from crds_and_namespace(kube, "op")


@pytest.fixture(scope="module")
def operator(
    kube: Kube, ns: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    process = OperatorProcess(kube.env, [ns], log, drift_interval=DRIFT_INTERVAL)
    process.start()
    yield process
    process.stop()


# -- helpers ----------------------------------------------------------------------------


def md(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    return kube.get_json("modeldeployment", name, "-n", ns)


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    for cond in (body.get("status") or {}).get("conditions") or ():
        if cond["type"] == type_:
            return cond
    return {}


def is_ready(kube: Kube, ns: str, name: str) -> dict[str, Any] | None:
    """The body once Ready=True for its current generation, else None."""
    body = md(kube, ns, name)
    current = body["status"].get("observedGeneration") == body["metadata"]["generation"]
    return body if current and condition(body, "Ready").get("status") == "True" else None


def wait_body(
    kube: Kube, predicate: Callable[[], dict[str, Any] | None], timeout: float, what: str
) -> dict[str, Any]:
    """``kube.wait_for`` for predicates that return a ModelDeployment body when satisfied."""
    body = kube.wait_for(predicate, timeout, 0.2, what)
    assert body is not None
    return body


def wait_ready(kube: Kube, ns: str, name: str, timeout: float = 90) -> dict[str, Any]:
    return wait_body(kube, lambda: is_ready(kube, ns, name), timeout, f"{name} Ready")


def children(kube: Kube, ns: str, name: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    items = kube.get_json(KIND_ARGS, "-n", ns, "-l", f"kvflow.dev/deployment={name}")["items"]
    return {child_key(item): item for item in items}


def expected_children(body: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {child_key(c) for c in render_children(parse_model_deployment(body))}


def pods(kube: Kube, ns: str, name: str) -> list[dict[str, Any]]:
    items = kube.get_json("pods", "-n", ns, "-l", f"kvflow.dev/deployment={name}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def apply_example(kube: Kube, ns: str, path: Path) -> float:
    """kubectl apply, then the seconds until the ModelDeployment is Ready."""
    (body,) = [d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "ModelDeployment"]
    started = time.monotonic()
    kube.kubectl("apply", "-n", ns, "-f", str(path))
    wait_ready(kube, ns, body["metadata"]["name"])
    return time.monotonic() - started


def check_reconciled(kube: Kube, ns: str, name: str, roles: dict[str, int]) -> dict[str, Any]:
    body = wait_ready(kube, ns, name)
    found = children(kube, ns, name)
    assert set(found) == expected_children(body)
    for child in found.values():
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == (
            "ModelDeployment",
            name,
            body["metadata"]["uid"],
        )
        assert owner["controller"] is True
    fake_nodes = {n["metadata"]["name"] for n in kube.get_json("nodes", "-l", "type=kwok")["items"]}
    running = pods(kube, ns, name)
    by_role: dict[str, int] = {}
    for pod in running:
        assert pod["spec"]["nodeName"] in fake_nodes
        assert pod["status"]["phase"] == "Running"
        assert condition(pod, "Ready").get("status") == "True"
        role = pod["metadata"]["labels"]["kvflow.dev/role"]
        by_role[role] = by_role.get(role, 0) + 1
    assert by_role == roles
    status_roles = {key: value for key, value in body["status"]["roles"].items()}
    for role, count in roles.items():
        key = "mooncakeMaster" if role == "mooncake-master" else role
        assert status_roles[key] == {
            "desired": count,
            "ready": count,
            "updated": count,
            "summary": f"{count}/{count}",
        }
    assert body["status"]["endpoint"] == f"http://{name}.{ns}.svc:8000/v1"
    return body


def patch_and_wait(kube: Kube, ns: str, name: str, spec_patch: dict[str, Any]) -> dict[str, Any]:
    """Merge-patch the spec, then wait until the new generation is Ready."""
    generation = md(kube, ns, name)["metadata"]["generation"]
    kube.kubectl(
        "patch", "md", name, "-n", ns, "--type", "merge", "-p", json.dumps({"spec": spec_patch})
    )

    def rolled_out() -> dict[str, Any] | None:
        body = is_ready(kube, ns, name)
        return body if body and body["metadata"]["generation"] > generation else None

    return wait_body(kube, rolled_out, 90, f"{name} generation > {generation} Ready")


def report(record_property: Any, label: str, seconds: float) -> None:
    record_property(label, f"{seconds:.2f}")
    print(f"apply-to-Ready {label}: {seconds:.2f}s")


# -- tests ------------------------------------------------------------------------------


def test_unified_example_reconciles_to_ready(
    kube: Kube, ns: str, operator: OperatorProcess, record_property: Any
) -> None:
    seconds = apply_example(kube, ns, UNIFIED)
    report(record_property, "unified-embedded", seconds)
    body = check_reconciled(kube, ns, "smollm2", {"unified": 2, "router": 1})
    assert {c["type"]: c["status"] for c in body["status"]["conditions"]} == {
        "Ready": "True",
        "Progressing": "False",
        "Degraded": "False",
        "UnifiedReady": "True",
        "RouterReady": "True",
    }
    table = kube.kubectl("get", "md", "-n", ns).stdout.splitlines()
    assert table[0].split() == [
        "NAME",
        "MODE",
        "READY",
        "UNIFIED",
        "PREFILL",
        "DECODE",
        "ENDPOINT",
        "AGE",
    ]
    row = table[1].split()
    assert (
        row[:4] == ["smollm2", "unified", "True", "2/2"]
        and row[4] == f"http://smollm2.{ns}.svc:8000/v1"
    )


def test_disaggregated_example_reconciles_to_ready(
    kube: Kube, ns: str, operator: OperatorProcess, record_property: Any
) -> None:
    seconds = apply_example(kube, ns, DISAGGREGATED)
    report(record_property, "disaggregated-hicache", seconds)
    check_reconciled(
        kube, ns, "smollm2-pd", {"prefill": 1, "decode": 2, "router": 1, "mooncake-master": 1}
    )
    prefill = next(
        p
        for p in pods(kube, ns, "smollm2-pd")
        if p["metadata"]["labels"]["kvflow.dev/role"] == "prefill"
    )
    assert prefill["metadata"]["annotations"]["kvflow.dev/bootstrap-port"] == "8998"
    wide = kube.kubectl("get", "md", "smollm2-pd", "-n", ns, "-o", "wide").stdout.splitlines()
    assert "ROUTER" in wide[0].split()
    assert wide[1].split()[1:6] == ["disaggregated", "True", "1/1", "2/2", "1/1"]


def test_crash_looping_pod_is_degraded_with_its_reason_until_replaced(
    kube: Kube, ns: str, operator: OperatorProcess
) -> None:
    """kwok runs no containers, so the kubelet's report of a container that exits at once
    (a refused flag: exit 2) is written into one pod's status, as a kubelet would."""
    victim = next(
        p
        for p in pods(kube, ns, "smollm2")
        if p["metadata"]["labels"]["kvflow.dev/role"] == "unified"
    )
    name = victim["metadata"]["name"]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    refused = "kvflow serve: error: argument --role: invalid choice: 'mixed'"
    status = {
        "conditions": [
            {"type": t, "status": "False", "lastTransitionTime": now}
            for t in ("Ready", "ContainersReady")
        ],
        "containerStatuses": [
            {
                "name": "runtime",
                "image": victim["spec"]["containers"][0]["image"],
                "imageID": "",
                "ready": False,
                "restartCount": 4,
                "state": {
                    "waiting": {
                        "reason": "CrashLoopBackOff",
                        "message": "back-off 1m20s restarting failed container=runtime",
                    }
                },
                "lastState": {
                    "terminated": {
                        "exitCode": 2,
                        "reason": "Error",
                        "message": refused,
                        "startedAt": now,
                        "finishedAt": now,
                    }
                },
            }
        ],
    }
    kube.kubectl(
        "patch", "pod", name, "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip

    def degraded() -> dict[str, Any] | None:
        body = md(kube, ns, "smollm2")
        return body if condition(body, "Degraded").get("status") == "True" else None

    body = wait_body(kube, degraded, 30, "Degraded")
    got = condition(body, "Degraded")
    assert got["reason"] == "CrashLoopBackOff", got
    assert name in got["message"] and "exit code 2" in got["message"] and refused in got["message"]
    assert condition(body, "Ready")["status"] == "False"
    assert condition(body, "UnifiedReady")["reason"] == "CrashLoopBackOff"
    # The Deployment replaces a deleted pod; the new one is Ready and the condition clears.
    kube.kubectl("delete", "pod", name, "-n", ns, "--wait=false")
    body = wait_ready(kube, ns, "smollm2")
    assert condition(body, "Degraded")["status"] == "False"


def test_spec_change_rolls_out(kube: Kube, ns: str, operator: OperatorProcess) -> None:
    before = md(kube, ns, "smollm2")
    old_pods = {
        p["metadata"]["name"]
        for p in pods(kube, ns, "smollm2")
        if p["metadata"]["labels"]["kvflow.dev/role"] == "unified"
    }
    patch = {"unified": {"replicas": 3, "extraArgs": ["--chunked-prefill-size", "512"]}}
    body = patch_and_wait(kube, ns, "smollm2", patch)
    assert body["metadata"]["generation"] == before["metadata"]["generation"] + 1
    assert body["status"]["roles"]["unified"]["summary"] == "3/3"
    deployment = kube.get_json("deployment", "smollm2-unified", "-n", ns)
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-2:] == ["--chunked-prefill-size", "512"]
    assert deployment["spec"]["replicas"] == 3 and deployment["status"]["updatedReplicas"] == 3
    new_pods = {
        p["metadata"]["name"]
        for p in pods(kube, ns, "smollm2")
        if p["metadata"]["labels"]["kvflow.dev/role"] == "unified"
    }
    assert len(new_pods) == 3 and not new_pods & old_pods  # every pod replaced by the new template
    replica_sets = kube.get_json(
        "replicasets", "-n", ns, "-l", "kvflow.dev/role=unified,kvflow.dev/deployment=smollm2"
    )["items"]
    assert sorted(rs["spec"]["replicas"] for rs in replica_sets) == [0, 3]


def test_deleted_or_edited_children_are_repaired(
    kube: Kube, ns: str, operator: OperatorProcess
) -> None:
    before = children(kube, ns, "smollm2")
    victims = [
        ("apps/v1", "Deployment", "smollm2-router"),
        ("v1", "Service", "smollm2"),
        ("v1", "ConfigMap", "smollm2-runtime"),
        ("networking.k8s.io/v1", "NetworkPolicy", "smollm2-unified"),
    ]
    for _, kind, name in victims:
        kube.kubectl("delete", kind.lower(), name, "-n", ns, "--wait=false")
    kube.kubectl("scale", "deployment", "smollm2-unified", "-n", ns, "--replicas=7")
    started = time.monotonic()

    def repaired() -> bool:
        now = children(kube, ns, "smollm2")
        back = all(
            v in now and now[v]["metadata"]["uid"] != before[v]["metadata"]["uid"] for v in victims
        )
        return back and now[("apps/v1", "Deployment", "smollm2-unified")]["spec"]["replicas"] == 3

    kube.wait_for(repaired, 30, 0.2, "children repaired")
    print(f"drift repaired in {time.monotonic() - started:.2f}s")
    assert time.monotonic() - started < DRIFT_INTERVAL * 3
    assert set(children(kube, ns, "smollm2")) == set(before)
    wait_ready(kube, ns, "smollm2")


def _bind_volume(kube: Kube, ns: str, storage_class: str) -> None:
    """A statically provisioned ReadWriteMany volume for the file store to bind to."""
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{ns}-hicache"},
            "spec": {
                "capacity": {"storage": "100Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": storage_class,
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": f"/tmp/{ns}-hicache"},
            },
        }
    )


def test_file_store_volume_and_permanent_errors(
    kube: Kube, ns: str, operator: OperatorProcess
) -> None:
    storage_class = f"{ns}-rwx"
    _bind_volume(kube, ns, storage_class)
    store: dict[str, Any] = {
        "hostMemory": "4Gi",
        "sharedStore": {"type": "file", "size": "50Gi", "storageClassName": storage_class},
    }
    patch_and_wait(kube, ns, "smollm2", {"hiCache": store})
    claim = kube.get_json("pvc", "smollm2-hicache", "-n", ns)
    assert claim["status"]["phase"] == "Bound" and claim["spec"]["volumeName"] == f"{ns}-hicache"
    for pod in pods(kube, ns, "smollm2"):
        if pod["metadata"]["labels"]["kvflow.dev/role"] == "unified":
            claims = [
                v["persistentVolumeClaim"]["claimName"]
                for v in pod["spec"]["volumes"]
                if "persistentVolumeClaim" in v
            ]
            assert claims == ["smollm2-hicache"]

    try:
        # A claim's storage class cannot change: the API server refuses the apply for good.
        store["sharedStore"]["storageClassName"] = f"{ns}-other"
        kube.kubectl(
            "patch",
            "md",
            "smollm2",
            "-n",
            ns,
            "--type",
            "merge",
            "-p",
            json.dumps({"spec": {"hiCache": store}}),
        )

        def degraded_body() -> dict[str, Any] | None:
            body = md(kube, ns, "smollm2")
            return body if condition(body, "Degraded").get("status") == "True" else None

        body = wait_body(kube, degraded_body, 30, "Degraded")
        degraded = condition(body, "Degraded")
        assert (
            degraded["reason"] == "ApplyRejected" and "PersistentVolumeClaim" in degraded["message"]
        )
        assert condition(body, "Progressing")["reason"] == "ApplyRejected"
        assert body["status"]["observedGeneration"] < body["metadata"]["generation"]
        assert condition(body, "Ready")["status"] == "True"  # the previous generation keeps serving
        # The rejected apply's own events (its Deployment may have moved a generation, and a
        # foreign field manager from the edits of an earlier test outlives their repair, see
        # EditFilter) may still arrive, late on a loaded machine: the window starts after them.
        time.sleep(DRIFT_INTERVAL)
        log_before = operator.log()
        time.sleep(DRIFT_INTERVAL * 2)
        assert operator.running() and operator.healthy()
        log_during = operator.log()[len(log_before) :]
        rejections = log_during.count("ApplyRejected")
        assert rejections <= 4, f"{rejections} retries in {DRIFT_INTERVAL * 2}s: a hot loop"
        # Status events of children edited (and repaired) in earlier tests are not edits.
        assert "edited, repairing" not in log_during
    finally:
        # Fixing the spec clears the condition (and leaves the next tests a Ready object).
        body = patch_and_wait(kube, ns, "smollm2", {"hiCache": None})
    assert condition(body, "Degraded")["status"] == "False"
    kube.wait_for(
        lambda: (
            ("v1", "PersistentVolumeClaim", "smollm2-hicache") not in children(kube, ns, "smollm2")
        ),
        30,
    )


def test_mode_switch_prunes_obsolete_children(
    kube: Kube, ns: str, operator: OperatorProcess
) -> None:
    patch = {
        "mode": "unified",
        "prefill": None,
        "decode": None,
        "hiCache": None,
        "unified": {"replicas": 1},
    }
    name = "smollm2-pd"
    body = patch_and_wait(kube, ns, name, patch)
    kube.wait_for(
        lambda: set(children(kube, ns, name)) == expected_children(body), 30, 0.3, "pruned"
    )
    names = {key[2] for key in children(kube, ns, name)}
    assert not any(n.endswith(("-prefill", "-decode", "-mooncake-master")) for n in names)
    assert set(md(kube, ns, name)["status"]["roles"]) == {"unified", "router"}


def test_operator_restart_duplicates_nothing(
    kube: Kube, ns: str, operator: OperatorProcess
) -> None:
    def snapshot() -> dict[str, Any]:
        kids = {
            key: (c["metadata"]["uid"], c["metadata"]["resourceVersion"])
            for name in ("smollm2", "smollm2-pd")
            for key, c in children(kube, ns, name).items()
        }
        rs = sorted(r["metadata"]["name"] for r in kube.get_json("replicasets", "-n", ns)["items"])
        running = sorted(
            p["metadata"]["name"]
            for name in ("smollm2", "smollm2-pd")
            for p in pods(kube, ns, name)
        )
        return {"children": kids, "replicasets": rs, "pods": running}

    for name in ("smollm2", "smollm2-pd"):
        wait_ready(kube, ns, name)
    before = snapshot()
    applied = operator.log().count(": applied ")
    operator.kill()
    operator.start()
    # The new process re-applies every child of both ModelDeployments on resume...
    kube.wait_for(lambda: operator.log().count(": applied ") >= applied + 2, 30, 0.3, "resume")
    time.sleep(DRIFT_INTERVAL * 1.5)  # at least one drift sweep too
    after = snapshot()
    # ...and it changes nothing: same objects, same resourceVersions, same pods.
    assert after == before
    for name in ("smollm2", "smollm2-pd"):
        assert is_ready(kube, ns, name)


def test_deleting_the_model_deployment_removes_children(
    kube: Kube, ns: str, operator: OperatorProcess
) -> None:
    assert children(kube, ns, "smollm2-pd")
    kube.kubectl("delete", "md", "smollm2-pd", "-n", ns, "--wait=true", "--timeout=30s")
    kube.wait_for(
        lambda: not children(kube, ns, "smollm2-pd") and not pods(kube, ns, "smollm2-pd"),
        60,
        0.5,
        "garbage collection",
    )
    assert children(kube, ns, "smollm2")  # the other deployment is untouched
