"""Router-only edits roll only router pods; the router's API access is read-only pods, and
the chart lets the operator grant it (RBAC refuses to grant what the granter lacks)."""

from __future__ import annotations

import json
from typing import Any

from operator_testing import SPECS, chart_namespaced_rules, load_model_deployment

from kvflow.operator import parse_model_deployment, render_children
from kvflow.operator.names import ANNOTATION_CONFIG_HASH, LABEL_ROLE, ROUTER
from kvflow.operator.render import child_key

ROUTER_POLICIES = ("cache_aware", "power_of_two", "round_robin")


def _render(body: dict[str, Any]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {child_key(c): c for c in render_children(parse_model_deployment(body))}


def _deployments_by_role(
    children: dict[tuple[str, str, str], dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Each component's workload: a Deployment, or a role's LeaderWorkerSet (its pod
    templates under ``leaderWorkerTemplate``, compared here as ``template``)."""
    out = {}
    for c in children.values():
        if c["kind"] == "Deployment":
            out[c["spec"]["template"]["metadata"]["labels"][LABEL_ROLE]] = c
        elif c["kind"] == "LeaderWorkerSet":
            spec = {**c["spec"], "template": c["spec"]["leaderWorkerTemplate"]}
            out[c["metadata"]["labels"][LABEL_ROLE]] = {**c, "spec": spec}
    return out


def _router_edit(body: dict[str, Any]) -> dict[str, Any]:
    edited = json.loads(json.dumps(body))
    router = edited["spec"].setdefault("router", {})
    current = router.get("policy", "cache_aware")
    router["policy"] = next(p for p in ROUTER_POLICIES if p != current)
    router["replicas"] = router.get("replicas", 1) + 2
    return edited


def test_router_only_edit_leaves_worker_templates_byte_identical(spec_name: str) -> None:
    body = load_model_deployment(SPECS[spec_name])
    edited = _router_edit(body)
    before, after = _render(body), _render(edited)
    old, new = _deployments_by_role(before), _deployments_by_role(after)
    workers = sorted(set(old) - {ROUTER})
    assert workers, "a ModelDeployment has at least one worker role"
    for role in workers:
        template = json.dumps(old[role]["spec"]["template"])
        assert json.dumps(new[role]["spec"]["template"]) == template, role
        assert new[role]["spec"]["replicas"] == old[role]["spec"]["replicas"], role

    # The router rolls (its argv names the policy) and scales; it mounts no ConfigMap.
    policy = edited["spec"]["router"]["policy"]
    router = new[ROUTER]["spec"]
    argv = router["template"]["spec"]["containers"][0]["command"]
    assert argv[argv.index("--policy") + 1] == policy
    assert router["template"] != old[ROUTER]["spec"]["template"]
    assert router["replicas"] == edited["spec"]["router"]["replicas"]
    assert ANNOTATION_CONFIG_HASH not in router["template"]["metadata"]["annotations"]

    # Besides the router Deployment, only runtime.json (which records the policy) changes.
    changed = {key for key in before if before[key] != after[key]}
    (config_map,) = [key for key in changed if key[1] == "ConfigMap"]
    assert changed == {config_map, child_key(new[ROUTER])}
    runtime = json.loads(after[config_map]["data"]["runtime.json"])
    assert runtime["router"] == {"policy": policy}


def test_worker_config_hash_still_follows_worker_settings() -> None:
    body = load_model_deployment(SPECS["disaggregated-hicache"])
    before = _deployments_by_role(_render(body))
    body["spec"]["hiCache"]["writePolicy"] = "write_back"
    after = _deployments_by_role(_render(body))
    for role in ("prefill", "decode"):
        old = before[role]["spec"]["template"]["metadata"]["annotations"]
        new = after[role]["spec"]["template"]["metadata"]["annotations"]
        assert new[ANNOTATION_CONFIG_HASH] != old[ANNOTATION_CONFIG_HASH], role


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_router_role_reads_pods_and_nothing_else(spec_name: str) -> None:
    children = render_children(parse_model_deployment(load_model_deployment(SPECS[spec_name])))
    access = {c["kind"]: c for c in children if c["kind"] in ("ServiceAccount", "Role")}
    (binding,) = [c for c in children if c["kind"] == "RoleBinding"]
    role, account = access["Role"], access["ServiceAccount"]
    assert _grants(role["rules"]) == {("", "pods", v) for v in ("get", "list", "watch")}
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    namespace = account["metadata"]["namespace"]
    name = account["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]
    router = next(
        c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == name
    )
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == name
    # Only the router talks to the API server: no other pod gets a token.
    for deployment in children:
        if deployment["kind"] == "Deployment" and deployment is not router:
            pod = deployment["spec"]["template"]["spec"]
            assert pod["automountServiceAccountToken"] is False, deployment["metadata"]["name"]


def test_chart_lets_the_operator_grant_the_router_role() -> None:
    operator = _grants(chart_namespaced_rules())
    children = render_children(
        parse_model_deployment(load_model_deployment(SPECS["unified-embedded"]))
    )
    (role,) = [c for c in children if c["kind"] == "Role"]
    assert _grants(role["rules"]) <= operator, "the operator must hold what it grants"
    for resource in ("roles", "rolebindings"):
        for verb in ("create", "patch", "delete"):
            assert ("rbac.authorization.k8s.io", resource, verb) in operator
    rbac_verbs = {verb for group, _, verb in operator if group == "rbac.authorization.k8s.io"}
    assert not rbac_verbs & {"escalate", "bind", "*"}, "it may grant only what it holds"
