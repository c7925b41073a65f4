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
    from the spec; ``--max-running-requests`` (set only when the field is) stays open."""
    worker = crd_schema()["properties"]["spec"]["properties"]["unified"]["properties"]
    (rule,) = worker["extraArgs"]["x-kubernetes-validations"]
    listed = set(re.findall(r"'(--[a-z-]+)'", rule["rule"]))
    rendered = {*contract.SERVE_FLAGS, *contract.SERVE_RUNTIME_FLAGS} - {"--max-running-requests"}
    assert listed == rendered | set(contract.SERVE_FLAG_ALIASES)


def _role_argv(gpus: int, tp: int | None = None, mode: str = "unified") -> list[str]:
    body = load_model_deployment(SPECS["unified-embedded"])
    role = {"gpus": gpus} if tp is None else {"gpus": gpus, "tensorParallelSize": tp}
    if mode == "disaggregated":
        body["spec"] = {"mode": mode, "prefill": role, "decode": role}
        return _argv_by_role(body)["prefill"]
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
    for mode in ("unified", "disaggregated"):
        argv = _role_argv(gpus, tp, mode)
        assert (_flag(argv, "--tp-size"), _flag(argv, "--dp-size")) == (tp_flag, dp_flag), mode


def test_rendered_parallel_sizes_parse() -> None:
    from kvflow.runtime.server.args import parse_args

    engine = parse_args(_role_argv(8, 2)[2:]).engine
    assert (engine.tp_size, engine.dp_size) == (2, 4)


@pytest.mark.parametrize(("gpus", "tp"), [(4, 3), (0, 1), (2, 4)])
def test_tensor_parallel_size_must_divide_gpus(gpus: int, tp: int) -> None:
    with pytest.raises(SpecError, match=r"spec\.unified\.tensorParallelSize"):
        _role_argv(gpus, tp)
