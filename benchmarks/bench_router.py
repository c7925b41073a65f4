"""Router benchmark: ``kvflow router`` vs SGLang's ``sglang-router`` (PyPI, Rust).

    python benchmarks/bench_router.py run [--parts overhead,cache] [--rounds 2] [--baseline REV]
    python benchmarks/bench_router.py report benchmarks/results/router.json [--notes FILE]

``run`` measures (1) what each router adds in front of a fast streaming load target at 1,
32 and 256 streams (TTFB, per-chunk latency, requests/s per router CPU core), and (2)
output tok/s and the workers' cache hit rate of a shared-prefix workload over 4 real
``kvflow serve`` workers under kvflow's ``cache_aware``, ``power_of_two``,
``round_robin`` and sglang-router's ``cache_aware``. sglang-router is installed into its
own venv on first use (``--sglang-venv``). ``--baseline REV`` also runs the kvflow router
of git revision ``REV`` in the overhead part (rows ``kvflow@REV-<policy>``), for before/after
numbers taken in one run. Writes markdown plus the raw JSON. Everything
listens on 127.0.0.1, every request and run has a timeout, every process started is
stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from router import (
    CacheConfig,
    OverheadConfig,
    default_sglang_venv,
    ensure_sglang_router,
    render_markdown,
    run_cache_value,
    run_overhead,
)
from serving import load_average, machine_info
from serving.defaults import EMBEDDED_MODEL, int_list

_MODEL = EMBEDDED_MODEL
_OVERHEAD = OverheadConfig()
_CACHE = CacheConfig(model=str(_MODEL))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the benchmark")
    run.add_argument("--parts", default="overhead,cache", help="overhead and/or cache")
    run.add_argument("--rounds", type=int, default=2, help="rounds of each part")
    run.add_argument(
        "--streams",
        default=",".join(map(str, _OVERHEAD.concurrencies)),
        help="overhead: concurrent streams (default: %(default)s)",
    )
    run.add_argument("--duration-s", type=float, default=_OVERHEAD.duration_s)
    run.add_argument("--model", default=str(_MODEL), help="cache part: served model folder")
    run.add_argument("--groups", type=int, default=_CACHE.groups)
    run.add_argument("--questions-per-group", type=int, default=_CACHE.questions_per_group)
    run.add_argument("--prefix-len", type=int, default=_CACHE.prefix_len)
    run.add_argument("--output-len", type=int, default=_CACHE.output_len)
    run.add_argument("--clients", type=int, default=_CACHE.concurrency)
    run.add_argument(
        "--worker-args",
        default=shlex.join(_CACHE.worker_args),
        help="flags for each kvflow serve worker (default: %(default)s)",
    )
    run.add_argument("--sglang-venv", type=Path, default=default_sglang_venv())
    run.add_argument("--no-sglang", action="store_true", help="leave sglang-router out")
    run.add_argument("--baseline", help="overhead: also run the kvflow router of this git revision")
    run.add_argument("--out", type=Path, default=Path("benchmarks/results/router.md"))
    run.add_argument("--log-dir", type=Path, default=Path("/tmp/kvflow-bench-router"))
    report = commands.add_parser("report", help="re-render markdown from the JSON")
    report.add_argument("json", type=Path)
    report.add_argument("--notes", type=Path, help="markdown to add as hand-written notes")
    report.add_argument("--out", type=Path, help="default: the JSON's name with .md")
    return parser


def _write(doc: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    out.write_text(render_markdown(doc))
    print(f"wrote {out} and {out.with_suffix('.json')}", flush=True)


def _baseline_runtime(revision: str, into: Path) -> tuple[str, Path]:
    """``revision``'s short hash and a folder holding its ``runtime/router`` (git archive)."""
    short = subprocess.run(
        ["git", "rev-parse", "--short", revision], check=True, capture_output=True, text=True
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "archive", revision, "runtime/router"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return short, into / "runtime"


def _run(args: argparse.Namespace) -> None:
    parts = set(args.parts.split(","))
    doc: dict[str, Any] = {
        "command": shlex.join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {**machine_info(), "load average at start": load_average()},
        "failures": {},
    }
    sglang_python = None
    if not args.no_sglang:
        try:
            sglang_python = ensure_sglang_router(args.sglang_venv)
        except Exception as exc:  # report why, run kvflow alone
            doc["failures"]["sglang-router install"] = f"{type(exc).__name__}: {exc}"
    if "overhead" in parts:
        baseline_dir = Path(tempfile.mkdtemp(prefix="kvflow-router-baseline-"))
        baseline, baseline_runtime = (
            _baseline_runtime(args.baseline, baseline_dir) if args.baseline else (None, None)
        )
        config = OverheadConfig(
            concurrencies=int_list(args.streams),
            rounds=args.rounds,
            duration_s=args.duration_s,
            baseline=baseline,
        )
        try:
            rows = run_overhead(config, sglang_python, args.log_dir / "overhead", baseline_runtime)
            doc["overhead"] = {"config": vars(config), "rows": rows}
        except (RuntimeError, TimeoutError) as exc:
            doc["failures"]["overhead"] = str(exc)
            print(f"overhead FAILED: {exc}", flush=True)
        finally:
            shutil.rmtree(baseline_dir, ignore_errors=True)
        _write(doc, args.out)  # keep part 1 even if part 2 fails
    if "cache" in parts:
        config = CacheConfig(
            model=args.model,
            worker_args=tuple(shlex.split(args.worker_args)),
            groups=args.groups,
            questions_per_group=args.questions_per_group,
            prefix_len=args.prefix_len,
            output_len=args.output_len,
            concurrency=args.clients,
            rounds=args.rounds,
        )
        try:
            rows = run_cache_value(config, sglang_python, args.log_dir / "cache")
            doc["cache"] = {"config": vars(config), "rows": rows}
        except (RuntimeError, TimeoutError) as exc:
            doc["failures"]["cache"] = str(exc)
            print(f"cache FAILED: {exc}", flush=True)
    doc["machine"]["load average at end"] = load_average()
    _write(doc, args.out)


def main() -> None:
    args = _parser().parse_args()
    if args.command == "run":
        _run(args)
    else:
        doc = json.loads(args.json.read_text())
        if args.notes:
            doc["notes"] = args.notes.read_text()
            args.json.write_text(json.dumps(doc, indent=1) + "\n")
        out = args.out or args.json.with_suffix(".md")
        out.write_text(render_markdown(doc))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
