"""Helpers of the operator's unit tests (no cluster): example specs, the CRD, defaulting."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "kvflow.dev_modeldeployments.yaml"
CHART = REPO / "charts" / "kvflow-operator"
SPECS = {
    "unified-embedded": REPO / "examples" / "unified-embedded.yaml",
    "disaggregated-hicache": REPO / "examples" / "disaggregated-hicache.yaml",
    "hicache-file": Path(__file__).parent / "specs" / "hicache-file.yaml",
    "disaggregated-pvc": Path(__file__).parent / "specs" / "disaggregated-pvc.yaml",
    "host-network": Path(__file__).parent / "specs" / "host-network.yaml",
    "unified-tp": Path(__file__).parent / "specs" / "unified-tp.yaml",
    "disaggregated-tp": Path(__file__).parent / "specs" / "disaggregated-tp.yaml",
    "unified-nodes": Path(__file__).parent / "specs" / "unified-nodes.yaml",
}


def load_model_deployment(path: Path) -> dict[str, Any]:
    """The ModelDeployment document of a YAML file, with the identity the API server adds."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "ModelDeployment"]
    (body,) = docs
    body["metadata"].setdefault("namespace", "models")
    body["metadata"].setdefault("uid", "00000000-0000-4000-8000-000000000001")
    body["metadata"].setdefault("generation", 1)
    return body


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Structural defaulting as the API server does it: fill ``default`` of absent
    properties (recursively, defaults included), descend into present ones."""
    if isinstance(value, dict):
        value = dict(value)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(value[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in (schema.get("properties") or {}):
                    value[key] = apply_defaults(value[key], extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(item, schema["items"]) for item in value]
    return value


def chart_namespaced_rules() -> list[dict[str, Any]]:
    """The RBAC rules the chart gives the operator in each namespace it serves."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    block = re.search(
        r'define "kvflow-operator.namespacedRules" -}}\n(.*?)\n{{- end -}}', helpers, re.S
    )
    assert block is not None, "namespacedRules not found in _helpers.tpl"
    rules: list[dict[str, Any]] = yaml.safe_load(block.group(1))
    return rules
