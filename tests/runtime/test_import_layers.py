"""No import cycles in the runtime: between its modules, and between its packages.

Every ``kvflow.*`` import counts, those under ``TYPE_CHECKING`` and inside functions too:
a type-only cycle still says that a type sits on the wrong floor (``Req`` lives in
``kvflow.runtime.core``, below the cache, the sampler and the scheduler that share it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvflow.runtime

RUNTIME = Path(kvflow.runtime.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(RUNTIME).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("kvflow", "runtime", *parts))


def _imports(path: Path, name: str) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m.startswith("kvflow.runtime")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in RUNTIME.rglob("*.py")}
    return {
        name: {m for m in _imports(path, name) if m in modules and m != name}
        for name, path in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _package(module: str) -> str:
    return ".".join(module.split(".")[:3])  # kvflow.runtime.<package or module>


def test_no_module_import_cycle() -> None:
    graph = {
        name: {d for d in deps if not _is_parent_init(d, name)} for name, deps in _graph().items()
    }
    assert _cycle(graph) is None


def _is_parent_init(dep: str, name: str) -> bool:
    """A module importing its own package's ``__init__`` (re-exports) is not a cycle."""
    return name.startswith(dep + ".")


@pytest.mark.parametrize(
    "low,high",
    [
        ("kvflow.runtime.cache", "kvflow.runtime.scheduler"),
        ("kvflow.runtime.sampling", "kvflow.runtime.scheduler"),
        ("kvflow.runtime.core", "kvflow.runtime.scheduler"),
        ("kvflow.runtime.cuda_graph", "kvflow.runtime.model_runner"),
    ],
)
def test_lower_floor_never_imports_the_higher(low: str, high: str) -> None:
    graph = _graph()
    offenders = sorted(
        f"{name} -> {dep}"
        for name, deps in graph.items()
        if _package(name) == low or name == low
        for dep in deps
        if dep == high or dep.startswith(high + ".")
    )
    assert offenders == []


def test_no_package_import_cycle() -> None:
    packages: dict[str, set[str]] = {}
    for name, deps in _graph().items():
        here = _package(name)
        packages.setdefault(here, set()).update(_package(d) for d in deps if _package(d) != here)
    assert _cycle(packages) is None
