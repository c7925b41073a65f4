"""The runtime accepts every flag of the contract the operator renders, and nothing else is needed."""

from __future__ import annotations

import pytest

from kvflow import contract
from kvflow.runtime.server.args import build_parser, parse_args


def _option_strings() -> set[str]:
    return {opt for action in build_parser()._actions for opt in action.option_strings}


def test_every_contract_flag_is_a_runtime_flag():
    assert set(contract.SERVE_FLAGS) <= _option_strings()


def test_rendered_unified_command_parses():
    argv = contract.serve_argv(
        contract.ServeOptions(
            model_path="/models/m",
            served_model_name="m",
            port=8001,
            max_running_requests=64,
            extra_args=("--page-size", "4"),
        )
    )
    assert argv[:2] == ["kvflow", "serve"]
    args = parse_args(argv[2:])
    assert (
        args.port,
        args.model_name,
        args.engine.max_running_requests,
        args.engine.page_size,
    ) == (8001, "m", 64, 4)
    assert args.host == "0.0.0.0"


def test_unimplemented_contract_features_are_refused_clearly(capsys):
    argv = contract.serve_argv(contract.ServeOptions(hicache_host_memory_gb=4.0))
    with pytest.raises(SystemExit):
        parse_args(argv[2:])
    assert "not implemented" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(contract.serve_argv(contract.ServeOptions(role="prefill"))[2:])
