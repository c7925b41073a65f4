"""Every `kvflow` sub-command answers `--help`: its module imports and its parser builds.

Each runs as its own process, the way a user (or an image's build check) runs it, so an
import that only works because another test imported something first cannot hide.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]


def _kvflow(*args: str) -> subprocess.CompletedProcess[str]:
    # -P: the repository's top-level operator/ folder would shadow Python's operator.
    return subprocess.run(
        [sys.executable, "-P", "-m", "kvflow", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_every_command_is_listed_in_the_top_level_help() -> None:
    done = _kvflow("--help")
    assert done.returncode == 0, done.stderr
    for name in COMMANDS:
        assert f"  {name} " in done.stdout


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_subcommand_help_runs(name: str) -> None:
    done = _kvflow(name, "--help")
    assert done.returncode == 0, f"kvflow {name} --help failed:\n{done.stderr}"
    assert done.stdout.startswith(f"usage: kvflow {name} "), done.stdout[:200]
    assert "--help" in done.stdout


def test_unknown_command_is_refused_with_the_list() -> None:
    done = _kvflow("no-such-command")
    assert done.returncode == 2
    assert "unknown command 'no-such-command'" in done.stderr
    assert all(name in done.stderr for name in COMMANDS)


def test_serve_help_states_meanings_defaults_and_sglang_flags() -> None:
    done = _kvflow("serve", "--help")
    assert done.returncode == 0, done.stderr
    assert "--tp-size TP_SIZE, --tp TP_SIZE, --tensor-parallel-size TP_SIZE" in done.stdout
    assert "round_robin (in turn) or shortest_queue" in done.stdout
    assert "(default: round_robin)" in done.stdout
    assert "--enable-metrics      no effect: Prometheus metrics are always served" in done.stdout


def test_serve_refuses_an_sglang_flag_before_starting() -> None:
    done = _kvflow("serve", "--attention-backend", "flashinfer")
    assert done.returncode == 2
    assert "'flashinfer': not built in kvflow; use triton (CUDA)" in done.stderr
    assert "Traceback" not in done.stderr
