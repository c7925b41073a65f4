"""The CRD (the API's source of truth) against the operator's reading of it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml
from operator_testing import CRD_PATH, SPECS, apply_defaults, crd_schema, load_model_deployment

from kvflow.operator import GROUP, KIND, PLURAL, VERSION, parse_model_deployment
from kvflow.operator.paths import OPERATOR_ENV, OPERATOR_VOLUMES


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def walk(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}.*")


def test_identity_scope_short_name_and_status_subresource() -> None:
    doc = crd()
    assert doc["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    spec = doc["spec"]
    assert spec["group"] == GROUP and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == KIND and "md" in spec["names"]["shortNames"]
    (version,) = spec["versions"]
    assert version["name"] == VERSION and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    for column in ("Mode", "Ready", "Prefill", "Decode", "Endpoint", "Age"):
        assert column in columns


def test_schema_is_structural() -> None:
    for path, node in walk(crd_schema()):
        if path == ".metadata" or node.get("x-kubernetes-preserve-unknown-fields"):
            continue
        typed = "type" in node or node.get("x-kubernetes-int-or-string")
        assert typed, f"{path or '<root>'} has no type"
        if node.get("type") == "object" and path.startswith(".spec"):
            assert "properties" in node or "additionalProperties" in node, path


def test_every_cel_rule_has_a_message_naming_a_field() -> None:
    rules = [
        (path, rule)
        for path, node in walk(crd_schema())
        for rule in node.get("x-kubernetes-validations", [])
    ]
    assert len(rules) >= 12
    for path, rule in rules:
        message = rule.get("message", "")
        leaf = path.rsplit(".", 1)[-1].rstrip("[]")
        named = (
            "spec." in message
            or "metadata." in message
            or message.startswith(leaf)
            or leaf in message
        )
        assert named, f"{path}: {message!r}"


def test_crd_defaults_mean_what_the_operator_assumes(spec_name: str) -> None:
    body = load_model_deployment(SPECS[spec_name])
    defaulted = apply_defaults(body, crd_schema())
    assert defaulted != body  # the CRD does fill something in
    assert parse_model_deployment(defaulted) == parse_model_deployment(body)


def test_empty_spec_defaults_agree() -> None:
    body = {"metadata": {"name": "m", "namespace": "n", "uid": "u", "generation": 1}, "spec": {}}
    defaulted = apply_defaults(body, crd_schema())
    assert defaulted["spec"]["mode"] == "unified" and defaulted["spec"]["router"]["replicas"] == 1
    assert parse_model_deployment(defaulted) == parse_model_deployment(body)


def test_crd_refuses_the_env_names_and_volumes_the_operator_sets() -> None:
    """The CEL lists of reserved env names and volume names are the operator's own."""
    roles = crd_schema()["properties"]["spec"]["properties"]
    for role in ("unified", "prefill", "decode", "router", "mooncakeMaster"):
        env = roles[role]["properties"]["env"]
        assert env["x-kubernetes-list-type"] == "map"  # a name once per container
        (rule,) = env["items"]["x-kubernetes-validations"]
        assert set(re.findall(r"'([A-Z_]+)'", rule["rule"])) == set(OPERATOR_ENV), role
        (rule,) = roles[role]["properties"]["volumes"]["items"]["x-kubernetes-validations"]
        assert set(re.findall(r"'([a-z-]+)'", rule["rule"])) == set(OPERATOR_VOLUMES), role
