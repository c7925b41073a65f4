"""SGLang's launch flags: each works, maps, has no effect or is refused as its table says,
and docs/runtime.md shows that table."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvflow.runtime.server.args import build_parser, parse_args
from kvflow.runtime.server.sglang_flags import (
    SGLANG_FLAGS,
    VALUE_RULES,
    Alias,
    NoEffect,
    Refuse,
    Same,
    markdown,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"
REFUSED = [(flag, rule) for flag, rule in SGLANG_FLAGS.items() if isinstance(rule, Refuse)]
SWITCHES = [flag for flag, rule in SGLANG_FLAGS.items() if isinstance(rule, NoEffect)]


def _actions() -> dict[str, argparse.Action]:
    return {opt: a for a in build_parser()._actions for opt in a.option_strings}


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_docs_table_is_the_code_table() -> None:
    text = DOC.read_text()
    found = re.search(r"<!-- sglang-flags:begin[^\n]*\n(.*?)<!-- sglang-flags:end -->", text, re.S)
    assert found, "docs/runtime.md lost its sglang-flags markers"
    assert found.group(1) == markdown(), (
        "docs/runtime.md's SGLang flag table differs from runtime/server/sglang_flags.py: "
        "paste the output of markdown() between the markers"
    )


def test_supported_and_mapped_flags_are_kvflow_flags() -> None:
    actions = _actions()
    for flag, rule in SGLANG_FLAGS.items():
        if isinstance(rule, Same):
            assert flag in actions, f"{flag} is listed as supported but kvflow has no such flag"
            assert actions[flag].option_strings[0] == flag
        elif isinstance(rule, Alias):
            assert actions[flag] is actions[rule.target], f"{flag} should be {rule.target}"


def test_refused_and_no_effect_flags_are_not_kvflow_flags() -> None:
    """A kvflow flag that takes an SGLang name listed as refused (a new EngineConfig field,
    say) wins in the parser; the table must then say the flag is supported."""
    actions = _actions()
    for flag, rule in SGLANG_FLAGS.items():
        if isinstance(rule, Refuse | NoEffect):
            assert actions[flag].default is argparse.SUPPRESS, (
                f"{flag} is now a kvflow flag: mark it Same(...) in sglang_flags.py"
            )


@pytest.mark.parametrize(("flag", "rule"), REFUSED, ids=[flag for flag, _ in REFUSED])
def test_refused_flags_exit_2_naming_the_alternative(flag, rule, capsys) -> None:
    values = [] if rule.nargs == 0 else ["7"]
    err = _refused([flag, *values], capsys)
    assert f"error: {' '.join([flag, *values])}: {rule.alternative}" in err
    for value in rule.accepts:
        assert parse_args([flag, value]) == parse_args([])


@pytest.mark.parametrize("flag", SWITCHES)
def test_no_effect_switches_change_nothing(flag) -> None:
    assert parse_args([flag]) == parse_args([])


def test_aliases_set_their_kvflow_flag() -> None:
    args = parse_args(
        ["--model", "m", "--tp", "2", "--data-parallel-size", "3", "--random-seed", "5"]
    )
    assert (args.engine.model_path, args.engine.tp_size, args.engine.dp_size) == ("m", 2, 3)
    assert args.engine.seed == 5
    assert parse_args(["--tensor-parallel-size", "4", "--dp", "2"]).engine.tp_size == 4
    prefill = parse_args(
        ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9001"]
    )
    assert (prefill.role, prefill.kv_transfer.bootstrap_port) == ("prefill", 9001)
    assert parse_args(["--disaggregation-mode", "null"]).role == "unified"


def test_sglang_values_map_or_are_refused(capsys) -> None:
    assert parse_args(["--dtype", "half"]).engine.dtype == "float16"
    assert parse_args(["--dtype", "float"]).engine.dtype == "float32"
    assert parse_args(["--attention-backend", "torch_native"]).engine.attention_backend == "torch"
    assert parse_args(["--load-format", "safetensors"]).engine.load_format == "auto"
    err = _refused(["--attention-backend", "flashinfer"], capsys)
    assert "'flashinfer': " + VALUE_RULES["--attention-backend"].refusal in err
    err = _refused(["--load-balance-method", "total_tokens"], capsys)
    assert "round_robin or shortest_queue" in err
    err = _refused(["--device", "npu"], capsys)
    assert "cpu or cuda" in err


def test_value_rules_name_choice_flags_and_map_into_their_choices() -> None:
    actions = _actions()
    for flag, rule in VALUE_RULES.items():
        choices = actions[flag].choices
        assert choices, f"{flag} has no choices for its value rule to guard"
        assert set(rule.aliases.values()) <= set(choices), flag


def test_abbreviations_are_not_accepted(capsys) -> None:
    err = _refused(["--enable-m"], capsys)  # once the start of --enable-mixed-chunk
    assert "unrecognized arguments: --enable-m" in err


def test_kv_cache_dtype_takes_sglangs_values(capsys) -> None:
    assert parse_args([]).engine.kv_cache_dtype == "auto"
    for value in ("auto", "fp8_e4m3", "fp8_e5m2", "bfloat16"):
        assert parse_args(["--kv-cache-dtype", value]).engine.kv_cache_dtype == value
    assert parse_args(["--kv-cache-dtype", "bf16"]).engine.kv_cache_dtype == "bfloat16"
    for value in ("mxfp8", "nvfp4", "fp4_mx_block16", "fp8"):
        err = _refused(["--kv-cache-dtype", value], capsys)
        assert f"'{value}': " + VALUE_RULES["--kv-cache-dtype"].refusal in err
