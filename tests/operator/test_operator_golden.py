"""Golden files: every child the operator renders for each spec, byte for byte.

A change to a builder shows up as a diff of ``golden/<spec>.yaml`` in review. To accept an
intended change, regenerate and commit the files:

    KVFLOW_UPDATE_GOLDEN=1 .venv/bin/pytest tests/operator/test_operator_golden.py
    (or: make operator-golden)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from operator_testing import REPO, SPECS, load_model_deployment

from kvflow.operator import parse_model_deployment, render_children

GOLDEN = Path(__file__).parent / "golden"


class _GoldenDumper(yaml.SafeDumper):
    """No anchors/aliases; multi-line strings (ConfigMap JSON) as readable literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_GoldenDumper.add_representer(str, _str)


def rendered_yaml(name: str) -> str:
    md = parse_model_deployment(load_model_deployment(SPECS[name]))
    children = render_children(md)
    header = f"# Rendered from {SPECS[name].relative_to(GOLDEN.parents[2])}; see test_operator_golden.py.\n"
    return header + yaml.dump_all(children, Dumper=_GoldenDumper, sort_keys=False, width=100)


def test_rendered_children_match_golden_file(spec_name: str) -> None:
    path = GOLDEN / f"{spec_name}.yaml"
    text = rendered_yaml(spec_name)
    if os.environ.get("KVFLOW_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with KVFLOW_UPDATE_GOLDEN=1"
    assert text == path.read_text(), (
        f"{path} differs; if intended, regenerate (see module docstring)"
    )


def test_rendering_is_deterministic(spec_name: str) -> None:
    assert rendered_yaml(spec_name) == rendered_yaml(spec_name)


def test_rendering_is_the_same_in_another_process() -> None:
    """Two renders in one process share its hash seed, so they agree even when output
    follows set or dict-of-hash ordering; a second interpreter with another
    ``PYTHONHASHSEED`` renders every spec again and must give the same bytes."""
    ours = os.environ.get("PYTHONHASHSEED", "")  # unset or "random": a random seed
    seed = str(int(ours) + 1) if ours.isdigit() else "1"
    code = (
        "import json, sys\n"
        "from test_operator_golden import rendered_yaml\n"
        "print(json.dumps({name: rendered_yaml(name) for name in sys.argv[1:]}))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run(
        [sys.executable, "-P", "-c", code, *sorted(SPECS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    other = json.loads(done.stdout)
    for name in sorted(SPECS):
        assert other[name] == rendered_yaml(name), f"{name}: differs under PYTHONHASHSEED={seed}"
