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


def _disaggregated(
    prefill: int | dict[str, Any], decode: int | dict[str, Any], **spec: Any
) -> dict[str, Any]:
    """A disaggregated spec; a role given as a number is its ``gpus``."""
    body = load_model_deployment(SPECS["unified-embedded"])
    body["spec"] = {
        "mode": "disaggregated",
        "prefill": {"gpus": prefill} if isinstance(prefill, int) else prefill,
        "decode": {"gpus": decode} if isinstance(decode, int) else decode,
        **spec,
    }
    return body


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_prefill_and_decode_pods_shard_the_model_over_their_gpus(
    gpus: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each PD pod runs one copy with ``--tp-size gpus`` (no ``--dp-size``), the same size on
    both roles; the rendered commands parse with the runtime's own parser."""
    from kvflow.runtime.server.args import parse_args

    monkeypatch.setenv(contract.INTERNAL_KEY_ENV, "k")  # the decode needs it
    explicit = {"gpus": gpus, "tensorParallelSize": gpus}
    for prefill, decode in ((gpus, gpus), (explicit, gpus), (gpus, explicit)):
        argv = _argv_by_role(_disaggregated(prefill, decode))
        for role in ("prefill", "decode"):
            assert _flag(argv[role], "--tp-size") == str(gpus), role
            assert "--dp-size" not in argv[role], role
            engine = parse_args(argv[role][2:]).engine
            assert (engine.tp_size, engine.dp_size) == (gpus, 1)


@pytest.mark.parametrize(
    ("prefill", "decode", "field", "says"),
    [
        (2, 1, "spec.decode.gpus", "same tensor-parallel size"),
        (1, 4, "spec.decode.gpus", "same tensor-parallel size"),
        (0, 2, "spec.decode.gpus", "same tensor-parallel size"),
        (4, 2, "spec.decode.gpus", "same tensor-parallel size"),
        ({"gpus": 4, "tensorParallelSize": 2}, 2, "spec.prefill.tensorParallelSize", "--dp-size"),
        (2, {"gpus": 2, "tensorParallelSize": 1}, "spec.decode.tensorParallelSize", "--dp-size"),
    ],
)
def test_pd_parallelism_the_runtime_cannot_run_is_refused(
    prefill: Any, decode: Any, field: str, says: str
) -> None:
    """Data parallelism inside a PD pod (not built in the runtime) and prefill/decode of
    different tensor-parallel sizes (the runtime would refuse the decode at registration):
    the parser (admission's twin, and ``kvflow up``'s) refuses, naming the field."""
    with pytest.raises(SpecError, match=re.escape(says)) as refused:
        parse_model_deployment(_disaggregated(prefill, decode))
    assert refused.value.field_path == field
    parse_model_deployment(_disaggregated(0, 1))  # one copy of one rank each side runs
    parse_model_deployment(_disaggregated(1, 1))


def test_several_gpus_with_a_shared_store() -> None:
    """HiCache's storage tier runs with TP/DP (each rank stores its own heads' pages):
    unified workers and a prefill with a shared store take several GPUs."""
    body = load_model_deployment(SPECS["unified-embedded"])
    body["spec"]["unified"] = {**body["spec"]["unified"], "gpus": 2}
    body["spec"]["hiCache"] = {
        "hostMemory": "1Gi",
        "sharedStore": {"type": "file", "size": "10Gi"},
    }
    assert parse_model_deployment(body).workers[0].gpus == 2
    pd = parse_model_deployment(_disaggregated(2, 2, hiCache={"hostMemory": "1Gi"}))
    assert [w.tp_size for w in pd.workers] == [2, 2]


def test_crd_carries_the_parallelism_refusals() -> None:
    """The spec-level CEL rules that match the parser's refusals: no data parallelism in a
    PD pod, the same size on both roles."""
    rules = crd_schema()["properties"]["spec"]["x-kubernetes-validations"]
    by_field = {r.get("fieldPath"): r for r in rules if "tensorParallelSize" in r["rule"]}
    by_field[".decode.gpus"] = next(r for r in rules if r.get("fieldPath") == ".decode.gpus")
    for role in ("prefill", "decode"):
        rule = by_field[f".{role}.tensorParallelSize"]
        assert "self.mode != 'disaggregated'" in rule["rule"]
        assert f"self.{role}.tensorParallelSize == self.{role}.gpus" in rule["rule"]
        assert rule["reason"] == "FieldValueForbidden"
        assert "docs/parallelism.md" in rule["message"]
    same = by_field[".decode.gpus"]
    assert "self.prefill.gpus" in same["rule"] and "self.decode.gpus" in same["rule"]
    assert "same tensor-parallel size" in same["message"]
