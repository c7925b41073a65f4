"""Properties every rendered child must have, checked on every spec (golden files pin the
exact bytes; these say why the bytes are right)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from operator_testing import SPECS, load_model_deployment

from kvflow import contract
from kvflow.operator import SpecError, parse_model_deployment, render_children
from kvflow.operator.names import ANNOTATION_BOOTSTRAP_PORT, LABEL_ROLE
from kvflow.operator.quantity import parse_quantity


def children_of(name: str) -> list[dict[str, Any]]:
    return render_children(parse_model_deployment(load_model_deployment(SPECS[name])))


def by_kind(children: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in children if c["kind"] == kind}


def pod_specs(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        name: d["spec"]["template"]["spec"] for name, d in by_kind(children, "Deployment").items()
    }


def test_every_child_is_owned_labelled_and_named_within_limits(spec_name: str) -> None:
    body = load_model_deployment(SPECS[spec_name])
    for child in children_of(spec_name):
        meta = child["metadata"]
        (owner,) = meta["ownerReferences"]
        assert owner["uid"] == body["metadata"]["uid"] and owner["controller"] is True
        assert owner["kind"] == "ModelDeployment" and owner["name"] == body["metadata"]["name"]
        assert meta["namespace"] == body["metadata"]["namespace"]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvflow-operator"
        assert meta["labels"]["kvflow.dev/deployment"] == body["metadata"]["name"]
        assert meta["annotations"]["kvflow.dev/generation"] == "1"
        assert len(meta["name"]) <= 63


def test_pods_meet_the_restricted_pod_security_standard(spec_name: str) -> None:
    rdma = spec_name in (
        "disaggregated-pvc",
        "disaggregated-tp",
    )  # RDMA asks for IPC_LOCK, documented as the exception
    for name, pod in pod_specs(children_of(spec_name)).items():
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"] + pod.get("initContainers", []):
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"]["drop"] == ["ALL"]
            assert ctx["readOnlyRootFilesystem"] is True
            added = ctx["capabilities"].get("add", [])
            expect = ["IPC_LOCK"] if rdma and container["name"] == "runtime" else []
            assert added == expect, (name, container["name"])


def test_runtime_pods_follow_the_contract(spec_name: str) -> None:
    children = children_of(spec_name)
    md = parse_model_deployment(load_model_deployment(SPECS[spec_name]))
    http_ports = {f"{md.name}-{w.role}": w.http_port for w in md.workers}
    http_ports[f"{md.name}-router"] = md.router.http_port
    for name, pod in pod_specs(children).items():
        container = pod["containers"][0]
        argv = container["command"]
        if container["name"] == "mooncake-master":
            assert f"--rpc_port={md.mooncake_master.rpc_port}" in argv
            continue
        assert len(pod["containers"]) == 1, name
        serve_flags = {**contract.SERVE_FLAGS, **contract.SERVE_RUNTIME_FLAGS}
        flags = serve_flags if argv[1] == "serve" else contract.ROUTER_FLAGS
        assert argv[0] == "kvflow" and argv[1] in ("serve", "router"), name
        for flag in [a for a in argv[2:] if a.startswith("--")]:
            extra = flag in ("--max-prefill-tokens",)  # user extraArgs come last
            assert flag in flags or extra, (name, flag)
        assert container["ports"][0]["containerPort"] == http_ports[name]
        assert argv[argv.index("--port") + 1] == str(http_ports[name])
        for probe in ("startupProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["path"] == contract.HEALTH_PATH
        # A worker is ready once its model answers /health; the router once it has a
        # healthy worker of every role it needs.
        readiness = contract.HEALTH_PATH if argv[1] == "serve" else contract.ROUTER_READINESS_PATH
        assert container["readinessProbe"]["httpGet"]["path"] == readiness
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
        startup = container["startupProbe"]
        if argv[1] == "serve":  # model loading may take the whole startup window
            window = startup["periodSeconds"] * startup["failureThreshold"]
            assert window >= 1800, (name, window)


def test_prefill_pods_announce_their_bootstrap_port() -> None:
    for spec_name, port in (("disaggregated-hicache", 8998), ("disaggregated-pvc", 9000)):
        deployments = by_kind(children_of(spec_name), "Deployment")
        prefill = next(
            d for d in deployments.values() if d["metadata"]["labels"][LABEL_ROLE] == "prefill"
        )
        template = prefill["spec"]["template"]
        assert template["metadata"]["annotations"][ANNOTATION_BOOTSTRAP_PORT] == str(port)
        argv = template["spec"]["containers"][0]["command"]
        assert argv[argv.index("--bootstrap-port") + 1] == str(port)


def test_api_key_comes_from_the_secret_into_the_contract_env_var() -> None:
    for name, pod in pod_specs(children_of("disaggregated-hicache")).items():
        if "mooncake" in name:
            continue
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        ref = env[contract.API_KEY_ENV]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "smollm2-pd-api-key", "key": "api-key"}
    for pod in pod_specs(children_of("unified-embedded")).values():
        assert contract.API_KEY_ENV not in {e["name"] for e in pod["containers"][0].get("env", [])}


def test_memory_requests_include_hicache_tiers() -> None:
    gib = 2**30
    # Prefill: 1Gi requested + 1Gi host tier + 1Gi lent to the Mooncake store. The decode
    # role keeps no prefix cache, so it runs no tiers and requests what the spec says.
    pods = pod_specs(children_of("disaggregated-hicache"))
    for role, expected in (("prefill", 3 * gib), ("decode", gib)):
        resources = pods[f"smollm2-pd-{role}"]["containers"][0]["resources"]
        assert parse_quantity(resources["requests"]["memory"]) == expected
    # GPUs are requested and limited alike.
    resources = pod_specs(children_of("unified-tp"))["llama-tp-unified"]["containers"][0][
        "resources"
    ]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "4"
    # 24Gi + 16Gi host tier; the 32Gi limit grows by the same 16Gi. A file store lends no memory.
    resources = pod_specs(children_of("hicache-file"))["llama-files-unified"]["containers"][0][
        "resources"
    ]
    assert parse_quantity(resources["requests"]["memory"]) == 40 * gib
    assert parse_quantity(resources["limits"]["memory"]) == 48 * gib
    # No HiCache: requests pass through untouched.
    resources = pod_specs(children_of("unified-embedded"))["smollm2-unified"]["containers"][0][
        "resources"
    ]
    assert resources["requests"] == {"cpu": "500m", "memory": "2Gi"}


def test_children_per_variant() -> None:
    kinds = lambda name: sorted((c["kind"], c["metadata"]["name"]) for c in children_of(name))  # noqa: E731
    unified = kinds("unified-embedded")
    assert ("Deployment", "smollm2-unified") in unified and ("Service", "smollm2") in unified
    assert not any("mooncake" in n or "hicache" in n for _, n in unified)
    pd = kinds("disaggregated-hicache")
    for expected in [
        ("Deployment", "smollm2-pd-prefill"),
        ("Deployment", "smollm2-pd-decode"),
        ("Deployment", "smollm2-pd-router"),
        ("Deployment", "smollm2-pd-mooncake-master"),
        ("Service", "smollm2-pd-mooncake-master"),
        ("Service", "smollm2-pd-prefill"),
        ("Service", "smollm2-pd-decode"),
        ("ConfigMap", "smollm2-pd-runtime"),
        ("PodDisruptionBudget", "smollm2-pd-decode"),
        ("NetworkPolicy", "smollm2-pd-prefill"),
        ("Role", "smollm2-pd-router"),
    ]:
        assert expected in pd
    files = kinds("hicache-file")
    assert ("PersistentVolumeClaim", "llama-files-hicache") in files
    assert not any(kind == "NetworkPolicy" and "mooncake" in n for kind, n in files)


def test_headless_services_and_the_endpoint_service() -> None:
    services = by_kind(children_of("disaggregated-hicache"), "Service")
    assert services["smollm2-pd-prefill"]["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in services["smollm2-pd-prefill"]["spec"]["ports"]} == {
        "http",
        "bootstrap",
    }
    endpoint = services["smollm2-pd"]["spec"]
    assert endpoint["selector"] == {
        "kvflow.dev/deployment": "smollm2-pd",
        "kvflow.dev/role": "router",
    }
    assert "clusterIP" not in endpoint and endpoint["type"] == "ClusterIP"
    lb = by_kind(children_of("hicache-file"), "Service")["llama-files"]["spec"]
    assert lb["type"] == "LoadBalancer" and lb["ports"][0]["port"] == 80


def test_network_policy_opens_kv_ports_only_between_prefill_and_decode() -> None:
    policies = by_kind(children_of("disaggregated-pvc"), "NetworkPolicy")
    first, last = contract.KV_TRANSFER_PORT_RANGE

    def peers(policy: dict[str, Any], port: Any) -> list[list[str]]:
        found = []
        for rule in policy["spec"]["ingress"]:
            if any(p["port"] == port for p in rule.get("ports", [])):
                for peer in rule.get("from", [{}]):
                    exprs = peer.get("podSelector", {}).get("matchExpressions", [])
                    roles = [e["values"] for e in exprs if e["key"] == LABEL_ROLE]
                    found += roles or [["<namespaces>" if "namespaceSelector" in peer else "<any>"]]
        return found

    assert peers(policies["llama-pd-prefill"], "bootstrap") == [["decode"]]
    assert peers(policies["llama-pd-prefill"], first) == [["decode"]]
    assert peers(policies["llama-pd-decode"], first) == [["prefill"]]
    assert peers(policies["llama-pd-decode"], "http") == [["router"], ["<namespaces>"]]
    assert peers(policies["llama-pd-router"], "http") == [["<any>"]]
    kv_rule = next(
        r for r in policies["llama-pd-decode"]["spec"]["ingress"] if r["ports"][0]["port"] == first
    )
    assert kv_rule["ports"][0]["endPort"] == last


def test_config_change_rolls_pods_and_replica_change_does_not() -> None:
    body = load_model_deployment(SPECS["unified-embedded"])
    hash_of = lambda b: by_kind(render_children(parse_model_deployment(b)), "Deployment")[  # noqa: E731
        "smollm2-unified"
    ]["spec"]["template"]["metadata"]["annotations"]["kvflow.dev/config-hash"]
    before = hash_of(body)
    body["spec"]["unified"]["extraArgs"] = ["--chunked-prefill-size", "512"]
    assert hash_of(body) != before
    body2 = load_model_deployment(SPECS["unified-embedded"])
    body2["spec"]["unified"]["replicas"] = 5
    assert hash_of(body2) == before


def test_autoscaled_replicas_are_clamped_into_bounds() -> None:
    body = load_model_deployment(SPECS["disaggregated-hicache"])
    body["spec"]["decode"]["autoscaling"] = {
        "enabled": True,
        "maxReplicas": 4,
        "targets": {"queuePerReplica": 8},
    }
    body["spec"]["decode"]["replicas"] = 9  # maxReplicas is 4
    deployments = by_kind(render_children(parse_model_deployment(body)), "Deployment")
    assert deployments["smollm2-pd-decode"]["spec"]["replicas"] == 4


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"mode": "disaggregated"}, "spec.prefill"),
        ({"mode": "hybrid"}, "spec.mode"),
        ({"model": {"source": "pvc"}}, "spec.model.pvc"),
        ({"hiCache": {"sharedStore": {"type": "file", "size": "1Ti"}}}, "spec.hiCache.hostMemory"),
        (
            {"hiCache": {"hostMemory": "8Gi", "sharedStore": {"type": "file"}}},
            "spec.hiCache.sharedStore.size",
        ),
        ({"hiCache": {"hostMemory": "lots"}}, "spec.hiCache.hostMemory"),
        (
            {"unified": {"resources": {"requests": {"memory": "2 GB"}}}},
            "spec.unified.resources.requests.memory",
        ),
    ],
)
def test_spec_errors_name_the_field(patch: dict[str, Any], field: str) -> None:
    body = load_model_deployment(SPECS["unified-embedded"])
    body["spec"].update(patch)
    with pytest.raises(SpecError) as caught:
        parse_model_deployment(body)
    assert caught.value.field_path == field
    assert str(caught.value).startswith(field)


def test_host_network_roles_bind_distinct_host_ports_and_resolve_cluster_names() -> None:
    pods = pod_specs(children_of("host-network"))
    bound: list[int] = []
    for name, pod in pods.items():
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        for container in pod["containers"]:
            for port in container["ports"]:
                assert port["hostPort"] == port["containerPort"], name
                bound.append(port["hostPort"])
    assert len(bound) == len(set(bound)) == 7  # prefill 2, decode 1, router 1, master 3
    for name, pod in pod_specs(children_of("unified-embedded")).items():
        assert "hostNetwork" not in pod and "dnsPolicy" not in pod
        assert all("hostPort" not in p for p in pod["containers"][0]["ports"]), name


def test_role_images_env_volumes_and_mounts_are_rendered() -> None:
    children = children_of("host-network")
    pods = pod_specs(children)
    images = {name: pod["containers"][0]["image"] for name, pod in pods.items()}
    assert images == {
        "hostnet-prefill": "localhost/kvflow/runtime:prefill",
        "hostnet-decode": "localhost/kvflow/runtime:dev",  # spec.image, the default
        "hostnet-router": "localhost/kvflow/router:dev",
        "hostnet-mooncake-master": "localhost/kvflow/runtime:master",
    }
    prefill = pods["hostnet-prefill"]
    volumes = {v["name"]: v for v in prefill["volumes"]}
    assert volumes["rdma-devices"]["hostPath"] == {"path": "/dev/infiniband", "type": "Directory"}
    assert {"cache", "tmp", "shm", "config", "triton-cache"} <= set(volumes)
    mounts = {m["mountPath"]: m["name"] for m in prefill["containers"][0]["volumeMounts"]}
    assert mounts["/dev/infiniband"] == "rdma-devices"
    assert mounts["/var/cache/triton"] == "triton-cache"
    env = {e["name"]: e.get("value") for e in prefill["containers"][0]["env"]}
    assert env["MC_LOG_LEVEL"] == "warning"
    router_env = {e["name"]: e.get("value") for e in pods["hostnet-router"]["containers"][0]["env"]}
    assert router_env["KVFLOW_ROUTER_LOG"] == "debug"


def test_mooncake_master_placement_reaches_every_client() -> None:
    children = children_of("host-network")
    master, metadata = pod_specs(children)["hostnet-mooncake-master"]["containers"]
    # On the host network it binds its pod IP, not every interface of the node; the HTTP
    # metadata server runs beside it (the built-in one ignores its host flag).
    assert master["command"] == [
        "mooncake_master",
        "--rpc_port=30300",
        "--enable_http_metadata_server=false",
        "--metrics_port=30302",
        "--rpc_address=$(KVFLOW_POD_IP)",
        "--metrics_host=$(KVFLOW_POD_IP)",
    ]
    assert metadata["command"] == [
        "mooncake_http_metadata_server",
        "--host",
        "$(KVFLOW_POD_IP)",
        "--port",
        "30301",
    ]
    assert [p["name"] for p in master["ports"]] == ["rpc", "metrics"]
    assert metadata["ports"] == [{"name": "metadata", "containerPort": 30301, "hostPort": 30301}]
    # Off the host network: one container, the built-in metadata server on every interface.
    (default_master,) = pod_specs(children_of("disaggregated-hicache"))[
        "smollm2-pd-mooncake-master"
    ]["containers"]
    assert default_master["command"] == [
        "mooncake_master",
        "--rpc_port=50051",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_port=8080",
        "--metrics_port=9003",
    ]
    (config_map,) = by_kind(children, "ConfigMap").values()
    client = json.loads(config_map["data"]["mooncake.json"])
    assert client["master_server_address"] == "127.0.0.1:30300"
    assert client["metadata_server"] == "http://127.0.0.1:30301/metadata"
    argv = pod_specs(children)["hostnet-prefill"]["containers"][0]["command"]
    assert argv[argv.index("--hicache-storage-path") + 1] == "127.0.0.1:30300"
    # the decode role keeps no prefix cache: no tiers, no store client
    assert (
        "--hicache-storage-path"
        not in pod_specs(children)["hostnet-decode"]["containers"][0]["command"]
    )
    service = by_kind(children, "Service")["hostnet-mooncake-master"]
    assert [p["port"] for p in service["spec"]["ports"]] == [30300, 30301]
    # Without spec.mooncakeMaster.host, clients use the master's Service name.
    default = children_of("disaggregated-hicache")
    (config_map,) = by_kind(default, "ConfigMap").values()
    client = json.loads(config_map["data"]["mooncake.json"])
    assert client["master_server_address"] == "smollm2-pd-mooncake-master.models.svc:50051"
