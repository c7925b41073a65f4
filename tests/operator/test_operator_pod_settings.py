"""Per-role pod settings and ports: what ``parse.py`` refuses, naming the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_testing import SPECS, load_model_deployment

from kvflow.operator import SpecError, parse_model_deployment
from kvflow.operator.paths import OPERATOR_ENV
from kvflow.operator.render import render_children


def host_network() -> dict[str, Any]:
    return load_model_deployment(SPECS["host-network"])


def unified() -> dict[str, Any]:
    return load_model_deployment(SPECS["unified-embedded"])


def refused(body: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as caught:
        parse_model_deployment(body)
    return caught.value


def test_host_network_spec_parses_into_role_settings() -> None:
    md = parse_model_deployment(host_network())
    prefill, decode = md.workers
    assert (prefill.http_port, decode.http_port, md.router.http_port) == (30100, 30200, 30000)
    assert prefill.pods.host_network and md.router.pods.host_network
    assert md.worker_image(prefill) == "localhost/kvflow/runtime:prefill"
    assert md.worker_image(decode) == md.image
    master = md.mooncake_master
    assert (master.rpc_port, master.metadata_port, master.metrics_port) == (30300, 30301, 30302)
    assert master.host == "127.0.0.1" and md.mooncake_master_image.endswith(":master")


@pytest.mark.parametrize(
    ("volume", "field"),
    [
        ({"name": "config", "emptyDir": {}}, "spec.unified.volumes[0].name"),
        ({"emptyDir": {}}, "spec.unified.volumes[0].name"),
    ],
)
def test_volume_names_are_the_users_own(volume: dict[str, Any], field: str) -> None:
    body = unified()
    body["spec"]["unified"]["volumes"] = [volume]
    assert refused(body).field_path == field


def test_mounts_name_declared_volumes_outside_operator_paths() -> None:
    body = unified()
    role = body["spec"]["unified"]
    role["volumes"] = [{"name": "data", "emptyDir": {}}]
    role["volumeMounts"] = [{"name": "other", "mountPath": "/data"}]
    error = refused(body)
    assert error.field_path == "spec.unified.volumeMounts[0].name"
    assert "not one of spec.unified.volumes" in str(error)
    role["volumeMounts"] = [{"name": "data", "mountPath": "/models/"}]
    assert refused(body).field_path == "spec.unified.volumeMounts[0].mountPath"
    role["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    assert parse_model_deployment(body).workers[0].pods.volume_mounts[0]["mountPath"] == "/data"


def test_host_network_roles_need_distinct_ports() -> None:
    body = host_network()
    body["spec"]["decode"]["ports"]["http"] = 30100  # the prefill's
    error = refused(body)
    assert error.field_path == "spec.decode.ports.http"
    assert "spec.prefill.ports.http" in str(error) and "host network" in str(error)
    body = host_network()
    body["spec"]["mooncakeMaster"]["ports"]["metrics"] = 30000  # the router's
    assert refused(body).field_path == "spec.mooncakeMaster.ports.metrics"
    # Off the host network each pod has its own ports: the same numbers are fine.
    body = host_network()
    for role in ("prefill", "decode", "router", "mooncakeMaster"):
        body["spec"][role]["hostNetwork"] = False
    body["spec"]["decode"]["ports"]["http"] = 30100
    parse_model_deployment(body)


def test_one_pods_ports_differ_even_off_the_host_network() -> None:
    body = load_model_deployment(SPECS["disaggregated-hicache"])
    body["spec"]["prefill"]["ports"] = {"http": 8998}  # the bootstrap port
    assert refused(body).field_path == "spec.kvTransfer.bootstrapPort"
    body = host_network()
    body["spec"]["mooncakeMaster"]["ports"]["metadata"] = 30300
    assert refused(body).field_path == "spec.mooncakeMaster.ports.metadata"


def test_mooncake_master_settings_need_a_mooncake_store() -> None:
    body = copy.deepcopy(unified())
    body["spec"]["mooncakeMaster"] = {"hostNetwork": True}
    assert refused(body).field_path == "spec.mooncakeMaster"


def test_a_port_must_be_a_port() -> None:
    body = unified()
    body["spec"]["router"]["ports"] = {"http": 70000}
    assert refused(body).field_path == "spec.router.ports.http"


@pytest.mark.parametrize("role", ["unified", "router"])
@pytest.mark.parametrize("name", OPERATOR_ENV)
def test_env_names_the_operator_sets_are_refused(role: str, name: str) -> None:
    body = unified()
    body["spec"][role]["env"] = [{"name": "MY_FLAG", "value": "1"}, {"name": name, "value": "x"}]
    error = refused(body)
    assert error.field_path == f"spec.{role}.env[1].name"
    assert "set by the operator" in str(error)


def test_env_names_are_declared_once() -> None:
    body = host_network()
    body["spec"]["mooncakeMaster"]["env"] = [{"name": "A", "value": "1"}, {"name": "A"}]
    error = refused(body)
    assert error.field_path == "spec.mooncakeMaster.env[1].name"
    assert "declared twice" in str(error)
    body["spec"]["mooncakeMaster"]["env"] = [{"name": "A", "value": "1"}]
    assert parse_model_deployment(body).mooncake_master.pods.env == ({"name": "A", "value": "1"},)


def test_operator_env_names_every_variable_the_operator_renders() -> None:
    """Every env name in every container the operator renders (all specs, host network,
    Mooncake, an API key Secret) is one :data:`OPERATOR_ENV` reserves, so a user entry can
    never collide with one."""
    rendered: set[str] = set()
    for path in SPECS.values():
        body = load_model_deployment(path)
        for role in ("unified", "prefill", "decode", "router", "mooncakeMaster"):
            if role in body["spec"]:
                body["spec"][role]["env"] = []  # the operator's own only
        body["spec"].setdefault("endpoint", {})["apiKeySecretRef"] = {"name": "key"}
        for child in render_children(parse_model_deployment(body)):
            pod = child.get("spec", {}).get("template", {}).get("spec", {})
            for container in [*pod.get("containers", []), *pod.get("initContainers", [])]:
                if container.get("name") != "fetch-model":  # its own container, no user env
                    rendered |= {e["name"] for e in container.get("env", [])}
    assert rendered == set(OPERATOR_ENV)


def test_host_network_pods_bind_their_pod_ip_not_every_interface() -> None:
    """On the host network every role (workers, router, Mooncake master and its metadata
    server) binds the address the kubelet expands from ``$(KVFLOW_POD_IP)``, set from the
    pod's status; off it, every interface of the pod."""
    pod_ip_env = {"name": "KVFLOW_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    for on_host in (True, False):
        body = host_network()
        for role in ("prefill", "decode", "router", "mooncakeMaster"):
            body["spec"][role]["hostNetwork"] = on_host
        for child in render_children(parse_model_deployment(body)):
            if child["kind"] != "Deployment":
                continue
            for container in child["spec"]["template"]["spec"]["containers"]:
                argv, env = container["command"], container.get("env", [])
                if container["name"] == "mooncake-master":
                    flags = [a.split("=", 1) for a in argv if "=" in a]
                    binds = [v for k, v in flags if k.endswith(("_address", "_host"))]
                    # on the host network the metadata server is a container of its own
                    assert binds == (["$(KVFLOW_POD_IP)"] * 2 if on_host else []), argv
                else:
                    bind = argv[argv.index("--host") + 1]
                    assert bind == ("$(KVFLOW_POD_IP)" if on_host else "0.0.0.0"), argv
                if on_host:
                    assert [e for e in env if e["name"] == "KVFLOW_POD_IP"] == [pod_ip_env]
