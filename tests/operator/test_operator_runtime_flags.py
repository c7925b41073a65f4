"""Spec fields that become ``kvflow serve`` flags the runtime declares itself
(:data:`contract.SERVE_RUNTIME_FLAGS`): rendered where they mean something, parsed by the
real parser, and kept out of ``extraArgs`` by the CRD."""

from __future__ import annotations

import re
from typing import Any

import pytest
from operator_testing import SPECS, crd_schema, load_model_deployment

from kvflow import contract
from kvflow.operator import parse_model_deployment
from kvflow.operator.placement import cluster_worker_placement, serve_options
from kvflow.operator.roles import worker_runtime


def _argv_by_role(body: dict[str, Any]) -> dict[str, list[str]]:
    md = parse_model_deployment(body)
    return {
        w.role: contract.serve_argv(
            serve_options(worker_runtime(md, w), cluster_worker_placement(md, w, "/models"))
        )
        for w in md.workers
    }


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_runtime_declared_flags_are_runtime_flags() -> None:
    from kvflow.runtime.server.args import build_parser

    declared = {opt for action in build_parser()._actions for opt in action.option_strings}
    assert set(contract.SERVE_RUNTIME_FLAGS) <= declared
    assert not set(contract.SERVE_RUNTIME_FLAGS) & set(contract.SERVE_FLAGS)


def test_kv_transfer_backend_is_the_prefill_and_decode_transport() -> None:
    from kvflow.runtime.disagg.transport import KV_TRANSPORTS

    schema = crd_schema()["properties"]["spec"]["properties"]["kvTransfer"]["properties"]
    assert set(schema["backend"]["enum"]) <= set(KV_TRANSPORTS.choices())
    body = load_model_deployment(SPECS["disaggregated-hicache"])
    argv = _argv_by_role(body)
    assert _flag(argv["prefill"], "--disaggregation-transfer-backend") == "mooncake"
    assert _flag(argv["decode"], "--disaggregation-transfer-backend") == "mooncake"
    # a unified server has no PD transport (the runtime refuses the flag there), even when
    # its Mooncake store moves pages with the transfer engine
    unified = _argv_by_role(load_model_deployment(SPECS["unified-embedded"]))["unified"]
    assert "--disaggregation-transfer-backend" not in unified


def test_rendered_pd_commands_parse_with_their_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvflow.runtime.server.args import parse_args

    monkeypatch.setenv(contract.INTERNAL_KEY_ENV, "k")  # the decode needs it
    argv = _argv_by_role(load_model_deployment(SPECS["disaggregated-hicache"]))
    for role in ("prefill", "decode"):
        args = parse_args(argv[role][2:])
        assert args.kv_transfer is not None and args.kv_transfer.backend == "mooncake", role


def test_crd_keeps_rendered_flags_out_of_extra_args() -> None:
    """The CEL list of flags extraArgs may not set is every worker flag the operator renders
    from the spec; ``--max-running-requests`` (set only when the field is) stays open."""
    worker = crd_schema()["properties"]["spec"]["properties"]["unified"]["properties"]
    (rule,) = worker["extraArgs"]["x-kubernetes-validations"]
    listed = set(re.findall(r"'(--[a-z-]+)'", rule["rule"]))
    rendered = {*contract.SERVE_FLAGS, *contract.SERVE_RUNTIME_FLAGS} - {"--max-running-requests"}
    assert listed == rendered
