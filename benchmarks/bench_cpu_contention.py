"""CPU serving on a shared machine: decode speed with and without a competing busy process,
for the kernels on OpenMP (the tree at ``--baseline``, default settings) against this tree's
default (the kernels' own pool, ``kvflow/kernels/cpu/pool.py``), plus this tree with one
thread for reference.

Each engine is an in-process ``kvflow.Engine`` (the embedded SmolLM2-135M, float32) in a
subprocess of its own, loaded once and then asked for measurements over a pipe, so the
configurations alternate request by request. A round measures every engine idle and then
with a busy process (``while True: pass`` pinned to the last core, started and stopped by
this script); the engines' order alternates between rounds. Per measurement: one stream
(10-token prompt, ``--tokens`` new tokens, greedy, EOS ignored) and, unless
``--clients 0``, ``--clients`` prompts of 170 tokens at once with ``--agg-tokens`` new
tokens each (prefill included; the prefix cache flushed first, prompts new each round).
The load average is recorded before every measurement: the machine may be shared.

    python benchmarks/bench_cpu_contention.py --out benchmarks/results/cpu-contention.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The last commit whose CPU kernels ran on torch's OpenMP pool.
OPENMP_REV = "08c8332"

# One engine, driven over stdin/stdout. argv: the root of the tree to import kvflow from,
# the EngineConfig overrides as JSON.
WORKER = r"""
import importlib.util, json, random, sys, time
root = sys.argv[1]
if root:  # import kvflow from that tree (its package dirs map as setup.py maps them)
    dirs = {"kvflow": "kvflow", "kvflow.kernels": "kernels", "kvflow.runtime": "runtime",
            "kvflow.operator": "operator"}
    class TreeFinder:
        def find_spec(self, name, path=None, target=None):
            if name in dirs:
                where = f"{root}/{dirs[name]}"
                return importlib.util.spec_from_file_location(
                    name, f"{where}/__init__.py", submodule_search_locations=[where])
    sys.meta_path.insert(0, TreeFinder())
from kvflow.runtime.engine import Engine
engine = Engine(**json.loads(sys.argv[2]))
greedy = {"temperature": 0, "ignore_eos": True}
engine.generate(input_ids=[list(range(100, 300))], sampling_params={**greedy, "max_new_tokens": 8})
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    ask = json.loads(line)
    start = time.perf_counter()
    engine.generate(input_ids=[list(range(200, 210))],
                    sampling_params={**greedy, "max_new_tokens": ask["tokens"]})
    out = {"single": ask["tokens"] / (time.perf_counter() - start)}
    if ask["clients"]:
        engine.flush_cache()
        rng = random.Random(ask["seed"])
        prompts = [[rng.randint(100, 40000) for _ in range(170)] for _ in range(ask["clients"])]
        start = time.perf_counter()
        engine.generate(input_ids=prompts,
                        sampling_params={**greedy, "max_new_tokens": ask["agg_tokens"]})
        out["aggregate"] = ask["clients"] * ask["agg_tokens"] / (time.perf_counter() - start)
    print(json.dumps(out), flush=True)
"""

ENGINE_ARGS = {"max_total_tokens": 8192, "max_running_requests": 64}


class EngineProc:
    """One engine subprocess; :meth:`measure` sends a request and reads its answer."""

    def __init__(self, name: str, root: str, overrides: dict) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-c", WORKER, root, json.dumps({**ENGINE_ARGS, **overrides})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=tempfile.gettempdir(),  # not the repo root: its operator/ shadows the stdlib
        )
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine {self.name} exited ({self.proc.wait()})")
        return json.loads(line)

    def measure(self, **ask: int) -> dict:
        self.proc.stdin.write(json.dumps(ask) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class BusyProcess:
    """``while True: pass`` pinned to the last usable core, for the ``with`` block."""

    def __enter__(self) -> BusyProcess:
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", "while True: pass"])
        os.sched_setaffinity(self.proc.pid, {max(os.sched_getaffinity(0))})
        time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def extract(rev: str, into: Path) -> str:
    """The package dirs of ``rev`` under ``into`` (git archive: the index is not touched)."""
    archive = subprocess.run(
        ["git", "archive", rev, "kvflow", "kernels", "runtime", "operator"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return str(into)


def git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    except OSError:  # no git (a copy of the tree)
        return ""
    return done.stdout.strip()


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def run(args: argparse.Namespace) -> list[dict]:
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-") as tmp:
        base_root = args.baseline_tree or extract(args.baseline, Path(tmp))
        specs = [
            (f"OpenMP kernels ({args.baseline}), default threads", base_root, {}),
            ("pool kernels (this tree), default threads", str(REPO), {}),
        ]
        if args.one_thread:
            specs.append(("pool kernels (this tree), cpu_threads=1", str(REPO), {"cpu_threads": 1}))
        engines = [
            EngineProc(name, root, {**args.engine_args, **overrides})
            for name, root, overrides in specs
        ]
        try:
            for rnd in range(args.rounds):
                order = engines if rnd % 2 == 0 else engines[::-1]
                for busy in (False, True):
                    with BusyProcess() if busy else contextlib.nullcontext():
                        for engine in order:
                            load = os.getloadavg()
                            got = engine.measure(
                                tokens=args.tokens,
                                clients=args.clients,
                                agg_tokens=args.agg_tokens,
                                seed=rnd,
                            )
                            rec = {
                                "engine": engine.name,
                                "busy": busy,
                                "round": rnd,
                                "load": load,
                                **got,
                            }
                            records.append(rec)
                            print(json.dumps(rec), flush=True)
        finally:
            for engine in engines:
                engine.close()
    return records


def median(records: list[dict], engine: str, busy: bool, key: str) -> float | None:
    values = [r[key] for r in records if r["engine"] == engine and r["busy"] == busy and key in r]
    return statistics.median(values) if values else None


def report(args: argparse.Namespace, records: list[dict], command: str) -> str:
    engines = list(dict.fromkeys(r["engine"] for r in records))
    baseline = engines[0]
    keys = [("single", "1 stream")] + (
        [("aggregate", f"{args.clients} clients")] if args.clients else []
    )
    model = "embedded SmolLM2-135M, float32"
    if args.engine_args:
        model = f"engine args `{json.dumps(args.engine_args)}`"
    dirty = (
        " (with uncommitted changes)" if git("status", "--porcelain", "kernels", "runtime") else ""
    )
    lines = [
        "# CPU serving under contention: OpenMP kernels vs the kernels' own pool",
        "",
        "Generated by `benchmarks/bench_cpu_contention.py`; numbers are measured, never edited.",
        "",
        "```",
        command,
        "```",
        "",
        f"Run on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"`nproc` {os.cpu_count()}, CPU `{cpu_model()}`, kernel {platform.release()}; "
        f"this tree at {git('rev-parse', '--short', 'HEAD')}{dirty}, baseline {args.baseline}. "
        f"Engine output tok/s ({model}, greedy); medians of "
        f"{args.rounds} rounds; 'busy': a `while True: pass` process pinned to the last core. "
        "The machine is shared: see the load averages below, and read ratios within a round.",
        "",
        "| engine | "
        + " | ".join(f"{label} idle | {label} busy | busy/idle" for _, label in keys)
        + " |",
        "| --- |" + " ---: |" * (3 * len(keys)),
    ]
    for engine in engines:
        cells = []
        for key, _ in keys:
            idle, busy = median(records, engine, False, key), median(records, engine, True, key)
            cells += [f"{idle:.1f}", f"{busy:.1f}", f"{busy / idle:.2f}x"]
        lines.append(f"| {engine} | " + " | ".join(cells) + " |")
    lines += ["", "Ratios to the baseline (medians):", ""]
    for engine in engines[1:]:
        for key, label in keys:
            parts = []
            for busy in (False, True):
                ours, base = (
                    median(records, engine, busy, key),
                    median(records, baseline, busy, key),
                )
                parts.append(f"{'busy' if busy else 'idle'} {ours / base:.2f}x")
            lines.append(f"- {engine}, {label}: " + ", ".join(parts))
    lines += [
        "",
        "## Every measurement",
        "",
        "| round | busy | engine | load avg (1/5/15 min) before | 1 stream tok/s | "
        + ("aggregate tok/s |" if args.clients else ""),
        "| ---: | --- | --- | --- | ---: |" + (" ---: |" if args.clients else ""),
    ]
    for r in records:
        load = "/".join(f"{x:.2f}" for x in r["load"])
        agg = f" {r['aggregate']:.1f} |" if "aggregate" in r else ""
        lines.append(
            f"| {r['round']} | {'yes' if r['busy'] else 'no'} | {r['engine']} | {load} | {r['single']:.1f} |{agg}"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=OPENMP_REV, help="git revision of the OpenMP kernels")
    parser.add_argument(
        "--baseline-tree", help="an extracted tree of --baseline (kvflow/, kernels/, runtime/)"
    )
    parser.add_argument(
        "--engine-args",
        type=json.loads,
        default={},
        help='EngineConfig fields as JSON, e.g. \'{"load_format": "dummy", "model_path": ...}\'',
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48, help="new tokens of the single stream")
    parser.add_argument("--clients", type=int, default=32, help="prompts at once (0: skip)")
    parser.add_argument("--agg-tokens", type=int, default=16, help="new tokens per client")
    parser.add_argument("--no-one-thread", dest="one_thread", action="store_false")
    parser.add_argument("--out", type=Path, help="markdown report (default: print it)")
    args = parser.parse_args()
    command = "python " + " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
    records = run(args)
    text = report(args, records, command)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
