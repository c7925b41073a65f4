"""A Dockerfile read into stages of steps, so the registry-free image build
(`e2e.k8s.realnode.imagebuild`) runs the Dockerfile's own commands rather than a copy.

Only what kvflow's Dockerfiles use is understood: `ARG`, `FROM ... [AS name]`, `ENV`,
`RUN [--mount=type=bind,...]`, `COPY [--from=stage]`, `WORKDIR`, `USER`, and the metadata
instructions (`LABEL`, `EXPOSE`, `ENTRYPOINT`, `CMD`). Anything else is an error, so a
Dockerfile edit the build cannot follow fails loudly instead of being skipped.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BindMount", "Stage", "Step", "exec_form", "expand", "parse_dockerfile"]

_KNOWN = {"ARG", "FROM", "ENV", "RUN", "COPY", "WORKDIR", "USER", "LABEL", "EXPOSE",
          "ENTRYPOINT", "CMD"}  # fmt: skip
_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def expand(text: str, values: Mapping[str, str]) -> str:
    """`$NAME` and `${NAME}` replaced from `values` (unknown names: empty, as Docker does)."""
    return _VAR.sub(lambda m: values.get(m.group(1) or m.group(2), ""), text)


@dataclass(frozen=True)
class BindMount:
    """`RUN --mount=type=bind,source=S,target=T[,rw]`: S of the build context at T for
    the command only (read-only unless `rw`; writes are discarded either way)."""

    source: str
    target: str
    rw: bool


@dataclass(frozen=True)
class Step:
    """One instruction: its keyword, its text (variables unexpanded), and for `RUN` its
    bind mounts, for `COPY` its `--from`."""

    keyword: str
    text: str
    mounts: tuple[BindMount, ...] = ()
    copy_from: str | None = None


@dataclass
class Stage:
    """A `FROM` and the steps after it; `args` are the build args in scope at its end."""

    image: str
    name: str | None
    steps: list[Step] = field(default_factory=list)
    args: dict[str, str] = field(default_factory=dict)


def _instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, rest) per instruction, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = (pending + stripped).strip()
        pending = ""
        if whole:
            keyword, _, rest = whole.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _flags(rest: str) -> tuple[list[str], str]:
    """Leading `--flag=value` words of an instruction, and what follows them."""
    flags = []
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        flags.append(word)
        rest = rest.lstrip()
    return flags, rest


def _mount(flag: str) -> BindMount:
    fields = dict(
        part.split("=", 1) if "=" in part else (part, "true")
        for part in flag.removeprefix("--mount=").split(",")
    )
    if fields.get("type") != "bind":
        raise ValueError(f"only bind mounts are understood: {flag}")
    return BindMount(fields.get("source", "."), fields["target"], fields.get("rw") == "true")


def parse_dockerfile(path: Path, build_args: Mapping[str, str] | None = None) -> list[Stage]:
    """The stages of the Dockerfile at `path`, with `build_args` overriding `ARG` defaults."""
    overrides = dict(build_args or {})
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in _instructions(path.read_text()):
        if keyword not in _KNOWN:
            raise ValueError(f"{path.name}: {keyword} is not understood by the image build")
        scope = stages[-1].args if stages else global_args
        if keyword == "ARG":
            name, has_default, default = rest.partition("=")
            if name in overrides:
                scope[name] = overrides[name]
            elif has_default:
                scope[name] = expand(default, scope)
            else:  # in a stage: the global default, re-declared
                scope[name] = global_args.get(name, "") if stages else ""
            continue
        if keyword == "FROM":
            words = expand(rest, global_args).split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            # Global args are visible in a stage only when it declares them again (Docker).
            stages.append(Stage(image=words[0], name=name))
            continue
        if not stages:
            raise ValueError(f"{path.name}: {keyword} before FROM")
        flags, body = _flags(rest)
        # Left unexpanded: the build expands args and env as each step runs.
        text = body
        mounts = tuple(_mount(f) for f in flags if f.startswith("--mount="))
        copy_from = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
        unknown = [f for f in flags if not f.startswith(("--mount=", "--from="))]
        if unknown:
            raise ValueError(f"{path.name}: {keyword} flags not understood: {unknown}")
        stages[-1].steps.append(Step(keyword, text, mounts, copy_from))
    return stages


def exec_form(text: str) -> list[str]:
    """`["a", "b"]` (exec form) or `a b` (shell words) as an argv."""
    return list(json.loads(text)) if text.startswith("[") else shlex.split(text)
