"""Spec fields that become ``kvflow serve`` flags the runtime declares itself
(:data:`contract.SERVE_RUNTIME_FLAGS`): rendered where they mean something, parsed by the
real parser, and kept out of ``extraArgs`` by the CRD."""

from __future__ import annotations

import re
from typing import Any

import pytest
from operator_testing import SPECS, crd_schema, load_model_deployment

from kvflow import contract
from kvflow.operator import SpecError, parse_model_deployment
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
    from the spec and those the spec owns otherwise (``--lora-paths``);
    ``--max-running-requests`` (set only when the field is) stays open."""
    worker = crd_schema()["properties"]["spec"]["properties"]["unified"]["properties"]
    (rule,) = worker["extraArgs"]["x-kubernetes-validations"]
    listed = set(re.findall(r"'(--[a-z-]+)'", rule["rule"]))
    rendered = {*contract.SERVE_FLAGS, *contract.SERVE_RUNTIME_FLAGS} - {"--max-running-requests"}
    owned = set(contract.SERVE_FLAG_ALIASES) | set(contract.SERVE_SPEC_OWNED_FLAGS)
    assert listed == rendered | owned


def _role_argv(gpus: int, tp: int | None = None) -> list[str]:
    body = load_model_deployment(SPECS["unified-embedded"])
    role = {"gpus": gpus} if tp is None else {"gpus": gpus, "tensorParallelSize": tp}
    body["spec"]["unified"] = {**body["spec"]["unified"], **role}
    return _argv_by_role(body)["unified"]


@pytest.mark.parametrize(
    ("gpus", "tp", "tp_flag", "dp_flag"),
    [
        (0, None, None, None),  # CPU
        (1, None, None, None),
        (2, None, "2", None),  # default: one copy over every GPU
        (8, None, "8", None),
        (4, 2, "2", "2"),  # data parallelism inside the pod
        (4, 1, None, "4"),
        (4, 4, "4", None),
    ],
)
def test_gpus_become_tp_and_dp_sizes(
    gpus: int, tp: int | None, tp_flag: str | None, dp_flag: str | None
) -> None:
    argv = _role_argv(gpus, tp)
    assert (_flag(argv, "--tp-size"), _flag(argv, "--dp-size")) == (tp_flag, dp_flag)


def test_rendered_parallel_sizes_parse() -> None:
    from kvflow.runtime.server.args import parse_args

    engine = parse_args(_role_argv(8, 2)[2:]).engine
    assert (engine.tp_size, engine.dp_size) == (2, 4)


@pytest.mark.parametrize(("gpus", "tp"), [(4, 3), (0, 1), (2, 4)])
def test_tensor_parallel_size_must_divide_gpus(gpus: int, tp: int) -> None:
    with pytest.raises(SpecError, match=r"spec\.unified\.tensorParallelSize"):
        _role_argv(gpus, tp)


def _disaggregated(prefill_gpus: int, decode_gpus: int, **spec: Any) -> dict[str, Any]:
    body = load_model_deployment(SPECS["unified-embedded"])
    body["spec"] = {
        "mode": "disaggregated",
        "prefill": {"gpus": prefill_gpus},
        "decode": {"gpus": decode_gpus},
        **spec,
    }
    return body


@pytest.mark.parametrize(
    ("prefill", "decode", "field"),
    [(2, 1, "spec.prefill.gpus"), (1, 4, "spec.decode.gpus"), (0, 2, "spec.decode.gpus")],
)
def test_several_gpus_in_a_disaggregated_role_are_refused(
    prefill: int, decode: int, field: str
) -> None:
    """The operator does not render --tp-size/--dp-size for prefill/decode pods yet: the
    parser (admission's twin, and ``kvflow up``'s) says so."""
    with pytest.raises(SpecError, match="tensor or data parallelism") as refused:
        parse_model_deployment(_disaggregated(prefill, decode))
    assert refused.value.field_path == field
    parse_model_deployment(_disaggregated(1, 1))  # one GPU per pod runs


def test_several_gpus_with_a_shared_store_run_unified() -> None:
    """HiCache's storage tier runs with TP/DP (each rank stores its own heads' pages):
    unified workers with a shared store take several GPUs; a disaggregated role does not."""
    body = load_model_deployment(SPECS["unified-embedded"])
    body["spec"]["unified"] = {**body["spec"]["unified"], "gpus": 2}
    body["spec"]["hiCache"] = {
        "hostMemory": "1Gi",
        "sharedStore": {"type": "file", "size": "10Gi"},
    }
    assert parse_model_deployment(body).workers[0].gpus == 2
    with pytest.raises(SpecError, match="tensor or data parallelism") as refused:
        parse_model_deployment(_disaggregated(2, 1, hiCache={"hostMemory": "1Gi"}))
    assert refused.value.field_path == "spec.prefill.gpus"


def test_crd_carries_the_parallelism_refusals() -> None:
    """The spec-level CEL rules that match the parser's refusals, one per role field."""
    rules = crd_schema()["properties"]["spec"]["x-kubernetes-validations"]
    by_field = {r["fieldPath"]: r for r in rules if r.get("fieldPath", "").endswith(".gpus")}
    assert set(by_field) == {".prefill.gpus", ".decode.gpus"}  # unified takes any count
    for role in ("prefill", "decode"):
        rule = by_field[f".{role}.gpus"]
        assert "self.mode != 'disaggregated'" in rule["rule"]
        assert f"self.{role}.gpus <= 1" in rule["rule"]
    for rule in by_field.values():
        assert rule["reason"] == "FieldValueForbidden"
        assert "docs/parallelism.md" in rule["message"]
