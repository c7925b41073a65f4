"""`kvflow serve --help` states every flag's meaning and default; an EngineConfig field
without a help text fails here (runtime/server/engine_flag_help.py)."""

from __future__ import annotations

import argparse
import dataclasses

from kvflow import contract
from kvflow.runtime.config import EngineConfig
from kvflow.runtime.server.args import build_parser
from kvflow.runtime.server.engine_flag_help import ENGINE_FLAG_HELP


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_every_engine_field_has_a_help_text() -> None:
    fields = {f.name for f in dataclasses.fields(EngineConfig) if f.metadata.get("flag", True)}
    missing = sorted(
        name
        for name in fields
        if _flag(name) not in contract.SERVE_FLAGS and not ENGINE_FLAG_HELP.get(name)
    )
    assert not missing, f"add their --help texts to runtime/server/engine_flag_help.py: {missing}"
    stale = sorted(set(ENGINE_FLAG_HELP) - fields)
    assert not stale, f"help texts for fields EngineConfig no longer has: {stale}"


def test_every_flag_has_help_with_its_default() -> None:
    parser = build_parser()
    formatter = parser.formatter_class(prog=parser.prog)
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        text = formatter._get_help_string(action)
        assert action.help, f"{action.option_strings[0]} has no help text"
        if action.default is not argparse.SUPPRESS:  # SGLang's refused/no-effect flags
            assert "default" in text, f"{action.option_strings[0]}: no default in {text!r}"
    rendered = parser.format_help()
    assert "(default: 0.88)" in rendered  # --mem-fraction-static, from EngineConfig
    assert f"(default: {EngineConfig.max_running_requests})" in rendered
