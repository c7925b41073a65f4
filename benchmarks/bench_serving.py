"""Serving benchmark: kvflow vs ``transformers serve --continuous-batching``, radix on vs off.

    python benchmarks/bench_serving.py compare [--only kvflow] [--out benchmarks/results/serving.md]
    python benchmarks/bench_serving.py load --base-url http://127.0.0.1:8000 --concurrency 32
    python benchmarks/bench_serving.py report benchmarks/results/serving.json

``compare`` starts each server in turn on a free port (same model folder, same prompts),
runs the fixed-length workload (kvflow, transformers) and the shared-prefix workload
(kvflow with and without the radix cache) at each concurrency, and writes markdown plus the
raw JSON. ``load`` drives one already-running OpenAI-compatible server. ``report``
re-renders the markdown from a JSON file.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

from serving import (
    SERVERS,
    BenchConfig,
    Corpus,
    Endpoint,
    LaunchOptions,
    build_plan,
    fixed_length_prompts,
    load_average,
    machine_info,
    render_markdown,
    run_load,
    run_servers,
    select_servers,
    shared_prefix_prompts,
    summarize,
)
from serving.defaults import EMBEDDED_MODEL

_DEFAULTS = BenchConfig()
_MODEL = EMBEDDED_MODEL
_EOS_BODIES = {
    "ignore_eos": {"ignore_eos": True},
    "hf": SERVERS["transformers"].extra_body,
    "none": {},
}


def _by_concurrency(text: str) -> dict[int, int]:
    """``"1=8,32=32"`` -> ``{1: 8, 32: 32}``."""
    pairs = (item.split("=") for item in text.split(",") if item)
    return {int(clients): int(requests) for clients, requests in pairs}


def _format(table: dict[int, int]) -> str:
    """``{1: 8, 32: 32}`` -> ``"1=8,32=32"``."""
    return ",".join(f"{clients}={value}" for clients, value in table.items())


def _shape_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=str(_MODEL), help="Hugging Face folder (served model and tokenizer)"
    )
    parser.add_argument("--api", choices=["completions", "chat"], default=_DEFAULTS.api)
    parser.add_argument("--input-len", type=int, default=_DEFAULTS.input_len)
    parser.add_argument("--output-len", type=int, default=_DEFAULTS.output_len)
    parser.add_argument("--prefix-len", type=int, default=_DEFAULTS.prefix_len)
    parser.add_argument("--question-len", type=int, default=_DEFAULTS.question_len)
    parser.add_argument("--shared-output-len", type=int, default=_DEFAULTS.shared_output_len)
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=_DEFAULTS.run_timeout,
        help="seconds after which a run's unfinished requests are cancelled",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    compare = commands.add_parser("compare", help="start each server in turn and compare them")
    _shape_args(compare)
    compare.add_argument(
        "--only",
        help=f"comma-separated servers among {list(SERVERS)} (kvflow also selects kvflow-mixed and kvflow-no-radix)",
    )
    compare.add_argument(
        "--concurrency",
        default=",".join(map(str, _DEFAULTS.concurrencies)),
        help="client counts, comma-separated (default: %(default)s)",
    )
    for flag, table in (
        ("--fixed-requests", _DEFAULTS.fixed_requests),
        ("--shared-requests", _DEFAULTS.shared_requests),
        ("--shared-groups", _DEFAULTS.shared_groups),
    ):
        compare.add_argument(flag, default=_format(table), help="by clients (default: %(default)s)")
    compare.add_argument(
        "--workloads", default="fixed,shared", help="fixed and/or shared (default: %(default)s)"
    )
    compare.add_argument(
        "--rounds", type=int, default=1, help="repeat every server's runs, alternating servers"
    )
    compare.add_argument("--dtype", help="passed to every server (default: each one's auto)")
    compare.add_argument("--kvflow-args", default="", help="extra flags for kvflow serve")
    compare.add_argument(
        "--transformers-args", default="", help="extra flags for transformers serve"
    )
    compare.add_argument("--out", type=Path, default=Path("benchmarks/results/serving.md"))
    compare.add_argument("--json", type=Path, help="raw results (default: --out with .json)")
    compare.add_argument("--log-dir", type=Path, default=Path("build/bench-serving"))

    load = commands.add_parser("load", help="drive one running server")
    _shape_args(load)
    load.add_argument("--base-url", default="http://127.0.0.1:8000")
    load.add_argument("--workload", choices=["fixed", "shared"], default="fixed")
    load.add_argument("--concurrency", type=int, default=32)
    load.add_argument("--num-requests", type=int, default=32)
    load.add_argument(
        "--shared-groups", type=int, default=8, help="prefix groups (shared workload)"
    )
    load.add_argument(
        "--eos",
        choices=list(_EOS_BODIES),
        default="ignore_eos",
        help="how to get exact output lengths: ignore_eos (kvflow, SGLang, vLLM), "
        "hf (transformers serve's generation_config) or none",
    )
    load.add_argument("--model-name", help="the request's model field (default: left out)")
    load.add_argument("--api-key")
    load.add_argument("--json", type=Path)

    report = commands.add_parser("report", help="re-render the markdown from a results JSON")
    report.add_argument("json", type=Path)
    report.add_argument("--out", type=Path, default=Path("benchmarks/results/serving.md"))
    return parser


def _config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        concurrencies=tuple(int(c) for c in args.concurrency.split(",")),
        input_len=args.input_len,
        output_len=args.output_len,
        fixed_requests=_by_concurrency(args.fixed_requests),
        shared_groups=_by_concurrency(args.shared_groups),
        prefix_len=args.prefix_len,
        question_len=args.question_len,
        shared_output_len=args.shared_output_len,
        shared_requests=_by_concurrency(args.shared_requests),
        api=args.api,
        run_timeout=args.run_timeout,
    )


def _compare(args: argparse.Namespace) -> int:
    config = _config(args)
    specs = select_servers(args.only.split(",") if args.only else None)
    corpus = Corpus(Path(args.model) / "tokenizer.json")
    wanted = set(args.workloads.split(","))
    workloads = sorted({w for spec in specs for w in spec.workloads} & wanted)
    plan = build_plan(corpus, config, set(workloads))
    opts = LaunchOptions(
        args.model,
        args.dtype,
        sys.executable,
        {
            "kvflow": shlex.split(args.kvflow_args),
            "transformers": shlex.split(args.transformers_args),
        },
    )
    doc = {
        "command": "python benchmarks/bench_serving.py " + shlex.join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine_info(),
        "load_before": load_average(),
        "config": {**asdict(config), "model": args.model},
        "workloads": workloads,
        "rounds": args.rounds,
        "servers": {s.name: {"description": s.description, "eos_note": s.eos_note} for s in specs},
    }
    json_path = args.json or args.out.with_suffix(".json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    failures: dict[str, str] = {}
    # Results are written after every server: an interrupted run keeps them. Rounds repeat
    # the whole sequence (A B A B), so a burst of other work on the machine hits one round.
    for round_index, spec in itertools.product(range(1, args.rounds + 1), specs):
        spec_rows, spec_failures = run_servers([spec], plan, config, opts, args.log_dir)
        rows += [{**row, "round": round_index} for row in spec_rows]
        failures.update(spec_failures)
        doc.update(load_after=load_average(), rows=rows, failures=failures)
        json_path.write_text(json.dumps(doc, indent=1) + "\n")
        args.out.write_text(render_markdown(doc))
    print(f"wrote {args.out} and {json_path}")
    return 1 if failures else 0


def _load(args: argparse.Namespace) -> int:
    corpus = Corpus(Path(args.model) / "tokenizer.json")
    if args.workload == "fixed":
        prompts = fixed_length_prompts(corpus, args.num_requests, args.input_len)
        max_tokens = args.output_len
    else:
        prompts = shared_prefix_prompts(
            corpus, args.num_requests, args.shared_groups, args.prefix_len, args.question_len
        )
        max_tokens = args.shared_output_len
    endpoint = Endpoint(
        args.base_url, args.api, args.model_name, _EOS_BODIES[args.eos], args.api_key
    )
    load = load_average()
    summary = summarize(
        run_load(endpoint, prompts, args.concurrency, max_tokens, args.run_timeout), len(prompts)
    )
    row = {
        "server": args.base_url,
        "workload": args.workload,
        "load_average": load,
        **summary.as_dict(),
    }
    for key, value in row.items():
        print(f"{key:>20}: {value:.3f}" if isinstance(value, float) else f"{key:>20}: {value}")
    if args.json:
        args.json.write_text(json.dumps(row, indent=1) + "\n")
    return 0 if summary.succeeded == summary.requests else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "compare":
        return _compare(args)
    if args.command == "load":
        return _load(args)
    args.out.write_text(render_markdown(json.loads(args.json.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
