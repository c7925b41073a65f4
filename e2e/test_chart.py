"""The Helm chart against the real control plane: lint, render, install, upgrade, admission,
RBAC (the operator runs with the chart's ServiceAccount token) and uninstall."""

from __future__ import annotations

import copy
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.k8s import CommandError, Kube
from e2e.operator_process import OperatorProcess, service_account_kubeconfig
from kvflow import contract

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "kvflow-operator"
CRD_FILE = REPO / "crds" / "kvflow.dev_modeldeployments.yaml"
CRD_NAME = "modeldeployments.kvflow.dev"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def render(kube: Kube, *args: str) -> list[dict[str, Any]]:
    out = kube.helm("template", "kvflow", str(CHART), "--namespace", "kvflow-system", *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def crd_source() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


@pytest.fixture(scope="module")
def release(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The chart installed from an older copy (its CRD lacks a printer column), then
    upgraded to this checkout; uninstalled at the end."""
    namespace = f"kvflow-{uuid.uuid4().hex[:6]}"
    name = "kvflow"
    existing = kube.kubectl(
        "get", "crd", CRD_NAME, "--ignore-not-found", "-o", "name"
    ).stdout.strip()
    if existing:  # installed by other tests with kubectl: let this release adopt it
        kube.kubectl("label", "crd", CRD_NAME, "--overwrite", "app.kubernetes.io/managed-by=Helm")
        kube.kubectl(
            "annotate",
            "crd",
            CRD_NAME,
            "--overwrite",
            f"meta.helm.sh/release-name={name}",
            f"meta.helm.sh/release-namespace={namespace}",
        )
    old_chart = tmp_path_factory.mktemp("chart") / "kvflow-operator"
    shutil.copytree(CHART, old_chart)
    old_crd = crd_source()
    old_crd["spec"]["versions"][0]["additionalPrinterColumns"] = [
        c
        for c in old_crd["spec"]["versions"][0]["additionalPrinterColumns"]
        if c["name"] != "Router"
    ]
    (old_chart / "files" / "crds" / CRD_FILE.name).write_text(yaml.safe_dump(old_crd))
    # Adopting a CRD that kubectl applied takes over kubectl's fields (docs/operator.md).
    adopt = ["--force-conflicts"] if existing else []
    install = ["install", name, str(old_chart), "-n", namespace, "--create-namespace", *adopt]
    kube.helm(*install, "--wait", "--timeout", "120s")
    columns = kube.get_json("crd", CRD_NAME)["spec"]["versions"][0]["additionalPrinterColumns"]
    assert "Router" not in [c["name"] for c in columns]
    upgraded = kube.helm(
        "upgrade", name, str(CHART), "-n", namespace, "--wait", "--timeout", "120s"
    )
    yield {"name": name, "namespace": namespace, "upgrade_output": upgraded.stdout}
    kube.helm("uninstall", name, "-n", namespace, "--wait", check=False)
    kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


# -- without installing -----------------------------------------------------------------


def test_lint_strict(kube: Kube) -> None:
    kube.helm("lint", "--strict", str(CHART))
    kube.helm("lint", "--strict", str(CHART), "--set", "watchNamespaces={team-a,team-b}")


def test_template_renders_the_operator_and_the_crd(kube: Kube) -> None:
    docs = render(kube)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Deployment",
        "ServiceAccount",
    ]
    (crd,) = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    assert crd["spec"] == crd_source()["spec"]  # the chart ships the API as it is in crds/
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    assert (
        deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["kvflow", "operator"]
    assert f"--health-port={contract.OPERATOR_HEALTH_PORT}" in container["args"]
    assert container["ports"] == [
        {"name": "health", "containerPort": contract.OPERATOR_HEALTH_PORT},
        {"name": "metrics", "containerPort": contract.OPERATOR_METRICS_PORT},
    ]
    assert container["livenessProbe"]["httpGet"] == {
        "path": contract.OPERATOR_HEALTH_PATH,
        "port": "health",
    }
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_template_scopes_rbac_to_watched_namespaces(kube: Kube) -> None:
    docs = render(kube, "--set", "watchNamespaces={team-a,team-b}", "--set", "crds.install=false")
    roles = {
        (d["kind"], d["metadata"]["namespace"])
        for d in docs
        if d["kind"] in ("Role", "RoleBinding")
    }
    assert roles == {(k, n) for k in ("Role", "RoleBinding") for n in ("team-a", "team-b")}
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    verbs = {tuple(r["resources"]): r["verbs"] for r in cluster_role["rules"]}
    assert verbs == {
        ("customresourcedefinitions",): ["get", "list", "watch"],
        ("namespaces",): ["get", "list", "watch"],
        ("nodes",): ["list"],  # only to see whether any node advertises an RDMA resource
    }
    assert "CustomResourceDefinition" not in {d["kind"] for d in docs}
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("bogus=1", "bogus"),
        ("image.tagg=v1", "tagg"),
        ("rbac.enabled=true", "enabled"),
        ("workers=0", "workers"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
    ],
)
def test_values_schema_rejects_bad_values(kube: Kube, setting: str, complaint: str) -> None:
    with pytest.raises(CommandError) as caught:
        render(kube, "--set", setting)
    assert complaint in caught.value.stderr


# -- installed --------------------------------------------------------------------------


def test_install_and_upgrade(kube: Kube, release: dict[str, str]) -> None:
    ns = release["namespace"]
    status = json.loads(kube.helm("status", release["name"], "-n", ns, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed" and status["version"] == 2
    assert "kubectl apply -f examples/unified-embedded.yaml" in release["upgrade_output"]
    crd = kube.get_json("crd", CRD_NAME)
    established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert established["Established"] == "True"
    assert (
        crd["spec"]["versions"] == crd_source()["spec"]["versions"]
    )  # upgraded, Router column back
    deployment = kube.get_json("deployment", "kvflow-kvflow-operator", "-n", ns)
    assert deployment["status"].get("availableReplicas") == 1
    kube.get_json("serviceaccount", "kvflow-kvflow-operator", "-n", ns)
    kube.get_json("clusterrole", "kvflow-kvflow-operator")


def test_examples_are_accepted_with_printer_columns(
    kube: Kube, release: dict[str, str], kube_namespace: str
) -> None:
    for example in EXAMPLES:
        out = kube.kubectl("apply", "-n", kube_namespace, "-f", str(example)).stdout
        assert "modeldeployment.kvflow.dev/" in out
    header = kube.kubectl("get", "md", "-n", kube_namespace).stdout.splitlines()[0].split()
    assert header == ["NAME", "MODE", "READY", "UNIFIED", "PREFILL", "DECODE", "ENDPOINT", "AGE"]
    wide = kube.kubectl(
        "get", "modeldeployments", "-n", kube_namespace, "-o", "wide"
    ).stdout.splitlines()
    assert "ROUTER" in wide[0].split() and len(wide) == 1 + len(EXAMPLES)
    # Every pod setting at once (host network, ports, images, volumes, the Mooncake master's
    # placement) passes the CRD's rules.
    spec = REPO / "tests" / "operator" / "specs" / "host-network.yaml"
    out = kube.kubectl("apply", "-n", kube_namespace, "-f", str(spec)).stdout
    assert "modeldeployment.kvflow.dev/hostnet" in out
    kube.kubectl("delete", "md", "hostnet", "-n", kube_namespace)
    # Tensor parallelism in prefill/decode pods: 4 GPUs each, the same size on both roles.
    spec = REPO / "tests" / "operator" / "specs" / "disaggregated-tp.yaml"
    out = kube.kubectl("apply", "-n", kube_namespace, "-f", str(spec)).stdout
    assert "modeldeployment.kvflow.dev/llama-pd-tp" in out
    kube.kubectl("delete", "md", "llama-pd-tp", "-n", kube_namespace)
    # One copy over two nodes of 8 GPUs (a LeaderWorkerSet once the operator renders it).
    spec = REPO / "tests" / "operator" / "specs" / "unified-nodes.yaml"
    out = kube.kubectl("apply", "-n", kube_namespace, "-f", str(spec)).stdout
    assert "modeldeployment.kvflow.dev/llama-nodes" in out
    kube.kubectl("delete", "md", "llama-nodes", "-n", kube_namespace)


BASE = yaml.safe_load((REPO / "examples" / "unified-embedded.yaml").read_text())
INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("unknown mode", {"spec": {"mode": "hybrid"}}, 'spec.mode: Unsupported value: "hybrid"'),
    (
        "disaggregated without decode",
        {"spec": {"mode": "disaggregated", "unified": None, "prefill": {}}},
        "spec.decode: Required value",
    ),
    ("prefill in unified mode", {"spec": {"prefill": {"replicas": 1}}}, "spec.mode: Forbidden"),
    (
        "prefill and decode of different tensor-parallel sizes",
        {"spec": {"mode": "disaggregated", "unified": None, "prefill": {}, "decode": {"gpus": 2}}},
        "spec.decode.gpus: Forbidden",
    ),
    (
        "data parallelism in a prefill pod",
        {
            "spec": {
                "mode": "disaggregated",
                "unified": None,
                "prefill": {"gpus": 2, "tensorParallelSize": 1},
                "decode": {"gpus": 2},
            }
        },
        "spec.prefill.tensorParallelSize: Forbidden",
    ),
    (
        "autoscaling min above max",
        {"spec": {"unified": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}},
        "spec.unified.autoscaling.minReplicas",
    ),
    (
        "autoscaling without targets",
        {"spec": {"unified": {"autoscaling": {"enabled": True}}}},
        "spec.unified.autoscaling.targets: Required value",
    ),
    (
        "file store without size",
        {"spec": {"hiCache": {"hostMemory": "8Gi", "sharedStore": {"type": "file"}}}},
        "spec.hiCache.sharedStore.size: Required value",
    ),
    (
        "shared store without host memory",
        {"spec": {"hiCache": {"sharedStore": {"type": "mooncake"}}}},
        "spec.hiCache.hostMemory: Required value",
    ),
    (
        "pvc source without a claim",
        {"spec": {"model": {"source": "pvc"}}},
        "spec.model.pvc: Required value",
    ),
    ("negative replicas", {"spec": {"unified": {"replicas": -1}}}, "spec.unified.replicas"),
    ("port out of range", {"spec": {"endpoint": {"port": 70000}}}, "spec.endpoint.port"),
    (
        "KV usage above 1",
        {"spec": {"unified": {"autoscaling": {"targets": {"kvUsage": 1.5}}}}},
        "spec.unified.autoscaling.targets.kvUsage",
    ),
    (
        "operator-owned flag in extraArgs",
        {"spec": {"unified": {"extraArgs": ["--port=9000"]}}},
        "spec.unified.extraArgs",
    ),
    (
        "negative host memory",
        {"spec": {"hiCache": {"hostMemory": "-8Gi"}}},
        "spec.hiCache.hostMemory",
    ),
    (
        "unknown transfer protocol",
        {"spec": {"kvTransfer": {"protocol": "udp"}}},
        "spec.kvTransfer.protocol",
    ),
    (
        "name too long",
        {"metadata": {"name": "m" * 46}},
        "metadata.name must be at most 45 characters",
    ),
    ("unknown field", {"spec": {"replicas": 3}}, 'unknown field "spec.replicas"'),
    (
        "volume name the operator uses",
        {"spec": {"unified": {"volumes": [{"name": "cache", "emptyDir": {}}]}}},
        "spec.unified.volumes[0].name",
    ),
    (
        "env name the operator sets",
        {"spec": {"unified": {"env": [{"name": "KVFLOW_CACHE_DIR", "value": "/data"}]}}},
        "spec.unified.env[0].name",
    ),
    (
        "env name twice",
        {"spec": {"router": {"env": [{"name": "A", "value": "1"}, {"name": "A"}]}}},
        "spec.router.env[1]: Duplicate value",
    ),
    (
        "mount of an undeclared volume",
        {"spec": {"unified": {"volumeMounts": [{"name": "data", "mountPath": "/data"}]}}},
        "spec.unified.volumeMounts",
    ),
    (
        "mount over an operator path",
        {
            "spec": {
                "unified": {
                    "volumes": [{"name": "data", "emptyDir": {}}],
                    "volumeMounts": [{"name": "data", "mountPath": "/etc/kvflow"}],
                }
            }
        },
        "spec.unified.volumeMounts[0].mountPath",
    ),
    (
        "host-network roles on one port",
        {
            "spec": {
                "unified": {"hostNetwork": True, "ports": {"http": 31000}},
                "router": {"hostNetwork": True, "ports": {"http": 31000}},
            }
        },
        "host-network roles bind their ports on the node",
    ),
    (
        "prefill over several nodes",
        {
            "spec": {
                "mode": "disaggregated",
                "unified": None,
                "prefill": {"nodesPerReplica": 2},
                "decode": {},
            }
        },
        "spec.prefill.nodesPerReplica: Forbidden",
    ),
    (
        "tensor-parallel size over nodes other than every GPU of the group",
        {"spec": {"unified": {"gpus": 4, "nodesPerReplica": 2, "tensorParallelSize": 4}}},
        "spec.unified.tensorParallelSize",
    ),
    (
        "autoscaling over several nodes",
        {
            "spec": {
                "unified": {
                    "nodesPerReplica": 2,
                    "autoscaling": {"enabled": True, "targets": {"queuePerReplica": 4}},
                }
            }
        },
        "spec.unified.autoscaling: Forbidden",
    ),
    (
        "name too long for a LeaderWorkerSet",
        {"metadata": {"name": "m" * 39}, "spec": {"unified": {"nodesPerReplica": 2}}},
        "metadata.name must be at most 38 characters",
    ),
    (
        "Mooncake master without a Mooncake store",
        {"spec": {"mooncakeMaster": {"ports": {"rpc": 31001}}}},
        "spec.mooncakeMaster: Forbidden",
    ),
]


def _merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize(("case", "patch", "field_error"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_is_refused_naming_the_field(
    kube: Kube,
    release: dict[str, str],
    kube_namespace: str,
    case: str,
    patch: dict[str, Any],
    field_error: str,
) -> None:
    body = _merged(BASE, patch)
    done = kube.kubectl(
        "apply", "-n", kube_namespace, "-f", "-", input=json.dumps(body), check=False
    )
    assert done.returncode != 0, f"{case}: accepted"
    assert field_error in done.stderr, done.stderr[-2000:]
    assert kube.kubectl("get", "md", "-n", kube_namespace, "-o", "name").stdout.strip() == ""


def test_rbac_is_enough_for_the_operator_and_no_more(
    kube: Kube, release: dict[str, str], kube_namespace: str, tmp_path: Path
) -> None:
    ns, sa = release["namespace"], "kvflow-kvflow-operator"
    subject = f"system:serviceaccount:{ns}:{sa}"

    def can(verb: str, resource: str) -> bool:
        done = kube.kubectl(
            "auth", "can-i", verb, resource, "-n", kube_namespace, "--as", subject, check=False
        )
        return done.stdout.strip() == "yes"

    assert can("patch", "deployments.apps") and can("list", "modeldeployments.kvflow.dev")
    assert can("patch", "modeldeployments.kvflow.dev/status")
    for verb, resource in [
        ("delete", "modeldeployments.kvflow.dev"),
        ("get", "secrets"),
        ("create", "pods"),
        ("delete", "nodes"),
        ("create", "clusterroles"),
        ("update", "deployments.apps"),
    ]:
        assert not can(verb, resource), f"operator may {verb} {resource}"

    token = kube.kubectl("create", "token", sa, "-n", ns, "--duration", "1h").stdout.strip()
    admin = json.loads(kube.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
    env = dict(
        kube.env,
        KUBECONFIG=str(service_account_kubeconfig(admin, token, tmp_path / "sa.kubeconfig")),
    )
    operator = OperatorProcess(env, [kube_namespace], tmp_path / "operator.log", drift_interval=5)
    operator.start()
    try:
        for example in EXAMPLES:
            kube.kubectl("apply", "-n", kube_namespace, "-f", str(example))

        def all_ready() -> bool:
            items = kube.get_json("md", "-n", kube_namespace)["items"]
            ready = [
                c
                for md in items
                for c in md.get("status", {}).get("conditions", [])
                if c["type"] == "Ready" and c["status"] == "True"
            ]
            return len(items) == len(EXAMPLES) == len(ready)

        kube.wait_for(all_ready, 90, 0.5, "examples Ready under the chart's RBAC")
        assert "Forbidden" not in operator.log() and "forbidden" not in operator.log()
    finally:
        operator.stop()


def test_uninstall_keeps_the_crd_and_the_model_deployments(
    kube: Kube, release: dict[str, str], kube_namespace: str
) -> None:
    kube.kubectl("apply", "-n", kube_namespace, "-f", str(EXAMPLES[0]))
    kube.helm("uninstall", release["name"], "-n", release["namespace"], "--wait")
    assert kube.get_json("crd", CRD_NAME)["metadata"]["name"] == CRD_NAME
    assert kube.kubectl("get", "md", "-n", kube_namespace, "-o", "name").stdout.strip()
    gone = kube.kubectl(
        "get",
        "deployment",
        "kvflow-kvflow-operator",
        "-n",
        release["namespace"],
        "--ignore-not-found",
        "-o",
        "name",
    ).stdout.strip()
    assert gone == ""
