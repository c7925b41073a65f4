"""``kvflow router`` with its package taken from another revision: the benchmark's baseline.

    python -P baseline_router.py RUNTIME_DIR router [flags]

``RUNTIME_DIR`` holds ``router/`` as ``git archive REV runtime/router`` wrote it; it goes
first on ``kvflow.runtime``'s search path, so ``kvflow.runtime.router`` comes from there
and everything else (``kvflow.runtime.wire``, the contract) from this checkout.
"""

from __future__ import annotations

import sys

import kvflow.runtime

kvflow.runtime.__path__.insert(0, sys.argv[1])

import kvflow.runtime.router  # noqa: E402
from kvflow.cli import main  # noqa: E402

if not (kvflow.runtime.router.__file__ or "").startswith(sys.argv[1]):
    raise SystemExit(f"kvflow.runtime.router came from {kvflow.runtime.router.__file__}")
sys.exit(main(sys.argv[2:]))
