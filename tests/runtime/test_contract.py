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


def test_hicache_flags_parse_and_impossible_combinations_are_refused(capsys):
    hicache = contract.HiCacheOptions(4.0, "write_back", "file", "/mnt/kv")
    engine = parse_args(contract.serve_argv(contract.ServeOptions(hicache=hicache))[2:]).engine
    assert (engine.hicache_host_memory_gb, engine.hicache_write_policy) == (4.0, "write_back")
    assert (engine.hicache_storage, engine.hicache_storage_path) == ("file", "/mnt/kv")
    refused = {
        "storage without a host pool": contract.HiCacheOptions(storage="mooncake"),
        "a file store without a path": contract.HiCacheOptions(1.0, storage="file"),
    }
    refused_opts = {why: contract.ServeOptions(hicache=h) for why, h in refused.items()}
    refused_opts["the decode role"] = contract.ServeOptions(
        role="decode", hicache=contract.HiCacheOptions(1.0)
    )
    for why, opts in refused_opts.items():
        with pytest.raises(SystemExit):
            parse_args(contract.serve_argv(opts)[2:])
        assert "hicache" in capsys.readouterr().err.lower(), why


def test_contract_misuse_is_refused_clearly():
    with pytest.raises(SystemExit):  # the bootstrap endpoint is the prefill's
        parse_args(contract.serve_argv(contract.ServeOptions(role="decode", bootstrap_port=1))[2:])


def test_rendered_prefill_and_decode_commands_parse(monkeypatch):
    monkeypatch.setenv(contract.INTERNAL_KEY_ENV, "k")  # the decode needs it (or a list)
    prefill = parse_args(
        contract.serve_argv(
            contract.ServeOptions(role="prefill", bootstrap_port=9000, kv_transfer_protocol="tcp")
        )[2:]
    )
    assert prefill.role == "prefill" and prefill.kv_transfer is not None
    assert (prefill.kv_transfer.bootstrap_port, prefill.kv_transfer.protocol) == (9000, "tcp")
    decode = parse_args(contract.serve_argv(contract.ServeOptions(role="decode"))[2:])
    assert decode.role == "decode"


def _operator_pod_commands() -> dict[str, list[list[str]]]:
    """Every ``kvflow serve`` command the operator renders for the example and golden specs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
    from operator_testing import SPECS, load_model_deployment

    from kvflow.operator import parse_model_deployment, render_children

    commands: dict[str, list[list[str]]] = {}
    for name, path in SPECS.items():
        md = parse_model_deployment(load_model_deployment(path))
        for child in render_children(md):
            if child["kind"] != "Deployment":
                continue
            for container in child["spec"]["template"]["spec"]["containers"]:
                argv = [*container.get("command", []), *container.get("args", [])]
                if argv[:2] != ["kvflow", "serve"]:
                    continue
                env = {e["name"] for e in container.get("env", [])}
                if "decode" in argv:  # its pairs are checked with the internal key
                    assert contract.INTERNAL_KEY_ENV in env, (name, argv)
                commands.setdefault(name, []).append(argv[2:])
    return commands


def test_every_operator_rendered_serve_command_parses(monkeypatch):
    monkeypatch.setenv(contract.INTERNAL_KEY_ENV, "k")  # from the Secret the pods name
    commands = _operator_pod_commands()
    assert set(commands) >= {"unified-embedded", "disaggregated-pvc"}
    for argvs in commands.values():
        for argv in argvs:
            parse_args(argv)  # raises SystemExit on any refused flag


def _router_option_strings() -> set[str]:
    from kvflow.runtime.router.args import build_parser as build_router_parser

    return {opt for action in build_router_parser()._actions for opt in action.option_strings}


def test_every_router_contract_flag_is_a_router_flag():
    assert set(contract.ROUTER_FLAGS) <= _router_option_strings()


def test_rendered_router_commands_parse():
    from kvflow.runtime.router.args import parse_args as parse_router_args
    from kvflow.runtime.router.args import static_specs

    argv = contract.router_argv(
        contract.RouterOptions(
            policy="power_of_two",
            port=8100,
            worker_urls=("http://10.0.0.1:8000", "http://10.0.0.2:8000"),
            extra_args=("--max-concurrent", "64"),
        )
    )
    assert argv[:2] == ["kvflow", "router"]
    config = parse_router_args(argv[2:])
    assert (config.policy, config.port, config.admission.max_concurrent) == (
        "power_of_two",
        8100,
        64,
    )
    assert config.worker_urls == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    pd = parse_router_args(
        contract.router_argv(
            contract.RouterOptions(
                prefill_urls=("http://p:8000#9000",), decode_urls=("http://d:8000",)
            )
        )[2:]
    )
    assert [(s.url, s.role, s.bootstrap_port) for s in static_specs(pd)] == [
        ("http://p:8000", "prefill", 9000),
        ("http://d:8000", "decode", None),
    ]
    discovered = parse_router_args(
        contract.router_argv(
            contract.RouterOptions(discover_namespace="ns", discover_selector="app=m")
        )[2:]
    )
    assert discovered.discovers and not static_specs(discovered)
