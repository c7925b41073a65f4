"""Static checks of the Helm chart (rendering and linting run in e2e/test_chart.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml
from operator_testing import CHART, CRD_PATH, REPO, chart_namespaced_rules

from kvflow.operator import CHILD_KINDS


def test_chart_crd_is_a_byte_copy_of_crds() -> None:
    copies = sorted((CHART / "files" / "crds").glob("*.yaml"))
    sources = sorted((REPO / "crds").glob("*.yaml"))
    assert [p.name for p in copies] == [p.name for p in sources] == [CRD_PATH.name]
    for copy, source in zip(copies, sources, strict=True):
        assert copy.read_bytes() == source.read_bytes(), "run `make chart-crds`"


def _value_paths(node: Any, prefix: str = "") -> list[str]:
    paths = []
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else key
            paths.append(path)
            paths += _value_paths(value, path)
    return paths


def test_every_value_has_a_doc_comment() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    documented: list[str] = []
    stack: list[tuple[int, str]] = []
    for number, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        above = number - 1
        while above >= 0 and lines[above].strip().startswith("#") and "# --" not in lines[above]:
            above -= 1  # continuation lines of a multi-line doc comment
        if above >= 0 and lines[above].strip().startswith("# --"):
            documented.append(".".join(k for _, k in stack))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = sorted(set(_value_paths(values)) - set(documented))
    assert not missing, f"values without a `# --` comment: {missing}"


def _objects(schema: dict[str, Any], path: str = "$") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, schema)] if "properties" in schema else []
    for key, sub in (schema.get("properties") or {}).items():
        found += _objects(sub, f"{path}.{key}")
    return found


def test_values_schema_rejects_unknown_keys_and_covers_values() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    for path, node in _objects(schema):
        assert node.get("additionalProperties") is False, path
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])


def test_templates_are_named_kind_component() -> None:
    for template in (CHART / "templates").iterdir():
        if template.name.startswith("_") or template.name == "NOTES.txt":
            continue
        kind, _, component = template.stem.partition("-")
        assert template.suffix == ".yaml" and component, template.name
        text = template.read_text()
        kinds = {k.lower() for k in re.findall(r"^kind: (\w+)", text, re.M)}
        if kind == "customresourcedefinition":
            continue  # rendered from files/crds through toYaml
        assert kinds == {kind}, (template.name, kinds)


def test_rbac_covers_exactly_what_the_operator_applies() -> None:
    rules = chart_namespaced_rules()
    granted = {
        (group, resource): set(rule["verbs"])
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    plurals = {
        "ConfigMap": "configmaps",
        "ServiceAccount": "serviceaccounts",
        "Role": "roles",
        "RoleBinding": "rolebindings",
        "PersistentVolumeClaim": "persistentvolumeclaims",
        "Service": "services",
        "Deployment": "deployments",
        "PodDisruptionBudget": "poddisruptionbudgets",
        "NetworkPolicy": "networkpolicies",
        "LeaderWorkerSet": "leaderworkersets",
    }
    child_resources = set()
    for api_version, kind in CHILD_KINDS:
        group = api_version.rpartition("/")[0]
        child_resources.add((group, plurals[kind]))
        assert granted[(group, plurals[kind])] == {
            "get",
            "list",
            "watch",
            "create",
            "patch",
            "delete",
        }
    # Anything beyond the children is read-only or the operator's own resource.
    for key, verbs in granted.items():
        if key in child_resources:
            continue
        assert key[0] == "kvflow.dev" or verbs <= {"get", "list", "watch", "create", "patch"}, key
    assert "delete" not in granted[("kvflow.dev", "modeldeployments")]
