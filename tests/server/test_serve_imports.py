"""The HTTP process of ``kvflow serve`` never imports torch: its modules, the flags' parsing
and checks, the engine's "auto" values on a machine without a GPU, the checks before any
child starts and the embedded model's tokenizer all stay off it (``import torch`` alone is
1-2 s of a 2-core machine's start-up, before the scheduler could even be spawned).

Each probe runs as its own process, so a module another test imported cannot hide one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

HEAVY = ("torch", "numpy", "triton", "transformers", "safetensors", "xgrammar")

# A meta-path finder that refuses the heavy packages, as if they were not installed.
BLOCKER = f"""
import importlib.abc, sys
HEAVY = {HEAVY!r}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ImportError(f"{{name}} is blocked in this test")
        return None
sys.meta_path.insert(0, Blocker())
"""

PARENT = """
import os
from pathlib import Path
import kvflow.runtime.server.cli
from kvflow.runtime.config import _GPU_DEVICE_NODES, ModelConfig
from kvflow.runtime.models import check_supported, resolve_model_path
from kvflow.runtime.server.args import parse_args
from kvflow.runtime.server.parallel import check_parallel, rank_places
args = parse_args(["--port", "8123", "--context-length", "2048"])
model_path = resolve_model_path(args.engine.model_path, args.engine.load_format)
check_supported(ModelConfig.from_path(model_path), args.engine.context_length)
check_parallel(args.engine, args.role, model_path)
rank_places(args.engine)
if not any(os.path.exists(node) for node in _GPU_DEVICE_NODES):  # else torch asks CUDA
    assert args.engine.resolved().device == "cpu"
heavy = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
assert not heavy, heavy
print("ok")
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=150
    )


def test_serve_parent_starts_with_heavy_packages_blocked(model_path: Path) -> None:
    done = _run(BLOCKER + PARENT)  # model_path: the embedded model is converted already
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_blocker_really_blocks() -> None:
    done = _run(BLOCKER + "\ntry:\n    import torch\nexcept ImportError:\n    print('blocked')")
    assert done.stdout.strip() == "blocked", done.stderr


def test_embedded_tokenizer_loads_without_torch(model_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path\n"
        "from kvflow.runtime.tokenizer import load_tokenizer\n"
        f"tokenizer = load_tokenizer(Path({str(model_path)!r}))\n"
        "assert tokenizer.chat_template\n"
        "print('torch' in sys.modules)\n"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_scheduler_starts_without_transformers(model_path: Path) -> None:
    """Stop strings decode with the ``tokenizers`` decoder; transformers' tokenizer (seconds
    of import on 2 cores) loads for the first constrained request only."""
    code = (
        "import dataclasses, sys\n"
        "from kvflow.runtime.server.args import parse_args\n"
        "from kvflow.runtime.server.ipc import make_ipc_paths\n"
        "from kvflow.runtime.server.scheduler_process import SchedulerLoop\n"
        "args = parse_args(['--max-total-tokens', '4096'])\n"
        "args = dataclasses.replace(args, engine=args.engine.resolved())\n"
        "loop = SchedulerLoop(args, make_ipc_paths())\n"
        "assert loop.reqs.tokenizer is not None\n"
        "print('transformers' in sys.modules)\n"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_cpu_scheduler_serves_without_triton(model_path: Path) -> None:
    """On CPU the scheduler runs the native kernels and the torch references: Triton (and
    the CUDA libraries it loads, about 130 MB of the model process's memory) stays out,
    through a whole generation."""
    code = (
        "import sys\n"
        "from kvflow.runtime.engine import Engine\n"
        "engine = Engine(None, device='cpu', max_total_tokens=4096)\n"
        "engine.generate(input_ids=[[1, 2, 3]], sampling_params={'max_new_tokens': 2})\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))\n"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
