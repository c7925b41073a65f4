"""No Python is started with the repository root first on sys.path.

``python -m``, ``python -c`` and ``python -`` put the working directory first on sys.path;
from the repository root, its top-level ``operator/`` folder then shadows the standard
library's ``operator``. Such starts take ``-P`` (or run with ``PYTHONSAFEPATH=1``). A script
in a subfolder puts only its own folder first, which is safe when that folder shadows no
standard-library module (checked). Guarded here: the Makefile, mk/*.mk and scripts/*.sh
(strictly), and the ``[sys.executable, ...]`` launches in tests/, e2e/, benchmarks/ and
scripts/ (new ones strictly; the known ones are listed until their owners add ``-P``).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHELL_FILES = [REPO / "Makefile", *sorted(REPO.glob("mk/*.mk")), *sorted(REPO.glob("scripts/*.sh"))]
# An interpreter: make's $(PY), a venv's python, $PYTHON, or python/python3 on PATH.
_INTERPRETER = re.compile(
    r"""(?:\$\(PY\)|"?\$\(VENV\)/bin/python3?"?|"?\$\{?PYTHON\}?"?|"?\$\{?VENV\}?/bin/python3?"?"""
    r"""|\.venv/bin/python3?|(?<![\w/.-])python3?)(?=\s)"""
)
_UNSAFE_MODES = {"-m", "-c", "-"}
_SHELL_SYNTAX = {"]", "]]", "||", "&&", ";", "|", ")", "then"}
# Unsafe starts already there when this guard came, per file (outside the files of the
# change that added it); each owner is to add -P and take the file off: the tests fail
# when a count grows (a new one) or shrinks (fixed: lower it).
KNOWN_UNSAFE_STARTS = {
    "e2e/k8s/bins/wheel.py": 1,
    "e2e/operator_process.py": 1,
    "tests/operator/test_operator_import.py": 2,
}


def _logical_lines(path: Path) -> list[tuple[int, str]]:
    """Lines with backslash continuations joined, comments dropped."""
    lines, buffer, start = [], "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        if not buffer:
            start = number
        if raw.lstrip().startswith("#"):
            continue
        if raw.endswith("\\"):
            buffer += raw[:-1] + " "
            continue
        lines.append((start, buffer + raw))
        buffer = ""
    return lines


def _shadows_stdlib(folder: Path) -> list[str]:
    names = {p.stem if p.suffix == ".py" else p.name for p in folder.iterdir()}
    return sorted(names & set(sys.stdlib_module_names))


def _problem(args: list[str], line: str) -> str | None:
    """Why this start puts an unsafe folder first on sys.path (None: it does not)."""
    if "PYTHONSAFEPATH=1" in line:
        return None
    for arg in args:
        if arg == "-P":
            return None
        if arg in _UNSAFE_MODES or arg.startswith(("-m", "-c")):
            return f"{arg} without -P puts the working directory first on sys.path"
        if arg.startswith("-"):
            continue  # another interpreter option (-u, -O, ...)
        if arg in _SHELL_SYNTAX:
            return None  # the interpreter is tested (`[ -x python ]`), not started
        script = arg.strip("'\"")
        if "/" not in script:
            return f"{script} runs from the working directory without -P"
        folder = (REPO / script).parent
        shadowing = _shadows_stdlib(folder) if folder.is_dir() else []
        if folder == REPO or shadowing:
            return f"{script}'s folder shadows the standard library ({shadowing}): use -P"
        return None
    return None


def _shell_starts() -> list[tuple[str, str]]:
    found = []
    for path in SHELL_FILES:
        for number, line in _logical_lines(path):
            for match in _INTERPRETER.finditer(line):
                args = line[match.end() :].split()
                why = _problem(args, line)
                if why:
                    found.append((f"{path.relative_to(REPO)}:{number}", why))
    return found


def _check_counts(found: dict[str, int], python_files: bool) -> None:
    known = {f: n for f, n in KNOWN_UNSAFE_STARTS.items() if f.endswith(".py") == python_files}
    new = {f: n for f, n in found.items() if n > known.get(f, 0)}
    assert not new, f"start Python with -P (or PYTHONSAFEPATH=1) in: {new}"
    fixed = {f: n for f, n in known.items() if found.get(f, 0) < n}
    assert not fixed, f"fixed: lower or drop their KNOWN_UNSAFE_STARTS entries: {fixed}"


def test_makefile_mk_and_scripts_start_python_safely() -> None:
    starts = _shell_starts()
    found: dict[str, int] = {}
    for where, _ in starts:
        path = where.rsplit(":", 1)[0]
        found[path] = found.get(path, 0) + 1
    _check_counts(found, python_files=False)
    owned = [s for s in starts if not s[0].startswith("scripts/device_env.sh")]
    assert owned == []  # the Makefile, mk/*.mk and setup.sh strictly


def test_the_shell_guard_catches_unsafe_starts() -> None:
    assert _problem(["-m", "pytest"], "$(PY) -m pytest")
    assert _problem(["-c", "'import x'"], "python3 -c 'import x'")
    assert _problem(["setup.py"], "python setup.py")
    assert _problem(["-m", "pytest"], "PYTHONSAFEPATH=1 $(PY) -m pytest") is None
    assert _problem(["-u", "-P", "-m", "kvflow"], "") is None
    assert _problem(["benchmarks/bench_serving.py"], "") is None
    assert _problem(["]", "||"], '[ -x "$VENV/bin/python" ] || true') is None
    assert _INTERPRETER.search('"$VENV/bin/python" -m x') and _INTERPRETER.search("$(PY) -m x")
    assert not _INTERPRETER.search("$(PY_REPO_MODULE) e2e.k8s up")


def _is_sys_executable(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "executable"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def _python_launches(path: Path) -> int:
    """``[sys.executable, "-m" | "-c", ...]`` lists (unsafe without -P) in one file; a call
    that names its ``cwd=`` chose the folder put first, which is taken as deliberate."""
    tree = ast.parse(path.read_text(), str(path))
    with_cwd = {
        id(arg)
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and any(k.arg == "cwd" for k in call.keywords)
        for arg in call.args
    }
    count = 0
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.List | ast.Tuple)
            and len(node.elts) >= 2
            and id(node) not in with_cwd
        ):
            first, second = node.elts[0], node.elts[1]
            if _is_sys_executable(first) and isinstance(second, ast.Constant):
                count += second.value in _UNSAFE_MODES
    return count


def _launch_counts() -> dict[str, int]:
    counts = {}
    for folder in ("tests", "e2e", "benchmarks", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if ".venv" in path.parts or "site-packages" in path.parts:
                continue
            count = _python_launches(path)
            if count:
                counts[str(path.relative_to(REPO))] = count
    return counts


def test_python_launched_from_python_takes_dash_p() -> None:
    _check_counts(_launch_counts(), python_files=True)


@pytest.mark.parametrize("mode", ["-m", "-c"])
def test_the_launch_guard_catches_a_launch(tmp_path: Path, mode: str) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(f"import subprocess, sys\nsubprocess.run([sys.executable, {mode!r}, 'x'])\n")
    assert _python_launches(probe) == 1
    probe.write_text("import subprocess, sys\nsubprocess.run([sys.executable, '-P', '-m', 'x'])\n")
    assert _python_launches(probe) == 0
