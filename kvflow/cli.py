"""The ``kvflow`` command: one entry point, sub-commands imported lazily.

Each sub-command lives in the package that owns it, so ``kvflow operator`` never imports
torch and ``kvflow serve`` never imports kubernetes.
"""

from __future__ import annotations

import importlib
import sys

# sub-command -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": (
        "kvflow.runtime.server.cli",
        "main",
        "run the serving runtime (OpenAI-compatible API)",
    ),
    "generate": (
        "kvflow.runtime.cli",
        "generate_main",
        "generate offline with the in-process engine",
    ),
    "router": (
        "kvflow.runtime.router.cli",
        "main",
        "route requests over workers (cache-aware, PD pairing)",
    ),
    "operator": ("kvflow.operator.main", "main", "run the Kubernetes operator"),
    "up": ("kvflow.up", "main", "run a ModelDeployment file as local processes"),
}


def _usage() -> str:
    lines = ["usage: kvflow <command> [args]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, _, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"kvflow: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    result = getattr(importlib.import_module(module), func)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
