"""Prefill/decode disaggregation benchmark.

    python benchmarks/bench_pd.py compare [--input-lens 256,1024,2048] [--concurrency 1,4]
    python benchmarks/bench_pd.py interference --target pd=URL --target unified=URL --model DIR
    python benchmarks/bench_pd.py report benchmarks/results/pd.json [--notes FILE]
    python benchmarks/bench_pd.py short-ttft [--requests 40] [--input-len 32]

``short-ttft`` (CPU, about a minute) measures PD's fixed cost per request: short prompts
one at a time through both routers on a tiny dummy Llama, TTFT p50 PD vs unified and the
ratio (issue 29: <= 1.5x). Prints one JSON object (and writes it with ``--out``).

``compare`` (CPU, ``make bench-pd``) starts a prefill, a decode and a unified ``kvflow
serve`` with the same flags, ``kvflow router`` in PD mode in front of the pair and ``kvflow
router --worker-urls`` in front of the unified server, and sends the same prompts to both
routers, alternating which goes first each round: TTFT p50/p99 and output tok/s, plus the
KV transfer inside PD's TTFT from the prefill's ``/metrics`` (ms per 1,000 prompt tokens,
share of TTFT, GB/s). Writes markdown plus the raw JSON.

``interference`` is for the GPU machine (prefill and decode on separate GPUs; not run on
CPU): ITL p50/p99 of a steady stream of decodes, quiet and while long prompts keep
arriving, against servers already running. A setup on 2 GPUs, e.g.::

    export KVFLOW_INTERNAL_KEY=$(openssl rand -hex 32)  # the router signs pairs with it
    CUDA_VISIBLE_DEVICES=0 kvflow serve --model-path M --port 30001 --role prefill --bootstrap-port 8998 &
    CUDA_VISIBLE_DEVICES=1 kvflow serve --model-path M --port 30002 --role decode &
    kvflow router --port 30000 --prefill-urls http://127.0.0.1:30001#8998 --decode-urls http://127.0.0.1:30002 &
    CUDA_VISIBLE_DEVICES=2 kvflow serve --model-path M --port 30003 &   # unified, one GPU
    python benchmarks/bench_pd.py interference --model M \\
        --target pd=http://127.0.0.1:30000 --target unified=http://127.0.0.1:30003

(give the unified side two GPUs, e.g. two replicas behind ``kvflow router --worker-urls``,
to compare at equal hardware). Everything listens on 127.0.0.1; every request and run has a
timeout; every process started is stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from pd import CompareConfig, InterferenceConfig, render_markdown, run_compare, run_interference
from pd.short_ttft import ShortTTFTConfig, run_short_ttft
from serving import machine_info
from serving.defaults import EMBEDDED_MODEL, int_list

_MODEL = EMBEDDED_MODEL
_COMPARE = CompareConfig(model=str(_MODEL))
_INTERFERENCE = InterferenceConfig(targets=(), model=str(_MODEL))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    cmp = commands.add_parser("compare", help="PD vs unified on CPU (make bench-pd)")
    cmp.add_argument("--model", default=str(_MODEL), help="served model folder")
    cmp.add_argument("--input-lens", type=int_list, default=_COMPARE.input_lens)
    cmp.add_argument("--concurrency", type=int_list, default=_COMPARE.concurrencies)
    cmp.add_argument("--requests-per-client", type=int, default=_COMPARE.requests_per_client)
    cmp.add_argument("--output-len", type=int, default=_COMPARE.output_len)
    cmp.add_argument("--rounds", type=int, default=_COMPARE.rounds)
    cmp.add_argument(
        "--server-args",
        default=shlex.join(_COMPARE.server_args),
        help="flags for every kvflow serve (default: %(default)s)",
    )
    cmp.add_argument("--out", type=Path, default=Path("benchmarks/results/pd.md"))
    cmp.add_argument("--log-dir", type=Path, default=_COMPARE.log_dir)
    cmp.add_argument("--notes", type=Path, help="markdown to add as hand-written notes")
    inter = commands.add_parser("interference", help="for the GPU machine: ITL under long prompts")
    inter.add_argument("--target", action="append", required=True, help="NAME=BASE_URL (repeat)")
    inter.add_argument("--model", default=str(_MODEL), help="folder with tokenizer.json")
    for name in (
        "stream_clients",
        "stream_input_len",
        "stream_output_len",
        "long_input_len",
        "rounds",
    ):
        inter.add_argument(
            "--" + name.replace("_", "-"), type=int, default=getattr(_INTERFERENCE, name)
        )
    for name in ("long_interval_s", "phase_s", "warmup_s"):
        inter.add_argument(
            "--" + name.replace("_", "-"), type=float, default=getattr(_INTERFERENCE, name)
        )
    inter.add_argument("--out", type=Path, default=Path("benchmarks/results/pd-interference.md"))
    inter.add_argument("--notes", type=Path)
    short = commands.add_parser("short-ttft", help="CPU: PD's fixed TTFT cost, short prompts")
    short.add_argument("--requests", type=int, default=ShortTTFTConfig.requests)
    short.add_argument("--input-len", type=int, default=ShortTTFTConfig.input_len)
    short.add_argument("--output-len", type=int, default=ShortTTFTConfig.output_len)
    short.add_argument("--log-dir", type=Path, default=ShortTTFTConfig.log_dir)
    short.add_argument("--out", type=Path, help="also write the JSON here")
    report = commands.add_parser("report", help="re-render markdown from the JSON")
    report.add_argument("json", type=Path)
    report.add_argument("--notes", type=Path)
    report.add_argument("--out", type=Path, help="default: the JSON's name with .md")
    return parser  # fmt: skip


def _write(results: dict, out: Path, notes: Path | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.write_text(render_markdown(results, notes.read_text() if notes else ""))
    print(f"wrote {out} and {out.with_suffix('.json')}")


def main() -> int:
    args = _parser().parse_args()
    if args.command == "report":
        results = json.loads(args.json.read_text())
        _write(results, args.out or args.json.with_suffix(".md"), args.notes)
        return 0
    if args.command == "short-ttft":
        short = ShortTTFTConfig(
            input_len=args.input_len,
            output_len=args.output_len,
            requests=args.requests,
            python=sys.executable,
            log_dir=args.log_dir,
        )
        text = json.dumps({"command": "python " + shlex.join(sys.argv), **run_short_ttft(short)})
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    command = "python " + shlex.join(sys.argv)
    machine = {"nproc": str(os.cpu_count()), **machine_info()}
    if args.command == "compare":
        cfg = CompareConfig(
            model=args.model,
            input_lens=args.input_lens,
            concurrencies=args.concurrency,
            requests_per_client=args.requests_per_client,
            output_len=args.output_len,
            rounds=args.rounds,
            server_args=tuple(shlex.split(args.server_args)),
            python=sys.executable,
            log_dir=args.log_dir,
        )
        results = run_compare(cfg)
    else:
        targets = tuple(tuple(t.split("=", 1)) for t in args.target)
        cfg_i = InterferenceConfig(
            targets=targets,  # type: ignore[arg-type]
            model=args.model,
            **{k: getattr(args, k) for k in ("stream_clients", "stream_input_len", "stream_output_len", "long_input_len", "rounds", "long_interval_s", "phase_s", "warmup_s")},
        )  # fmt: skip
        results = run_interference(cfg_i)
    results.update(command=command, machine=machine, finished=time.strftime("%Y-%m-%d %H:%M"))
    _write(results, args.out, args.notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
