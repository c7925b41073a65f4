"""The helpers of benchmarks/gpu_lora_serving.sh (SGLang's LoRA serving bar on one GPU):

- ``adapters CONFIG DIR NAME:RANK ...``: random PEFT adapters (every layer, all seven
  projections) for the model of a ``config.json``, written with safetensors (no peft);
- ``churn URL NAME=PATH ...``: loads and unloads those adapters through
  ``/load_lora_adapter`` and ``/unload_lora_adapter`` until SIGTERM or ``--seconds``,
  then writes each call's outcome and latency;
- ``summary OUT``: the phases' bench_serving JSON lines and the churn record against the
  bar's targets, as one JSON with pass/fail.

    python -P benchmarks/lora_serving.py adapters runtime/configs/llama-3.1-8b.json /tmp/a a:16
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["TARGETS", "projection_shapes", "write_adapter"]

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# phase -> (median TTFT ms, median end-to-end ms) upper bounds: SGLang's CI bar for
# Llama-3.1-8B (400 prompts at 8 requests/s, 256 in, 256 out); the base phase has none
TARGETS = {"lora": (58.0, 2400.0), "churn": (80.0, 4000.0)}


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """PEFT module -> (input width, output rows) of a Llama-shaped ``config.json``."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    return {
        "q_proj": (hidden, q_rows), "k_proj": (hidden, kv_rows), "v_proj": (hidden, kv_rows),
        "o_proj": (q_rows, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip


def write_adapter(
    folder: Path,
    shapes: dict[str, tuple[int, int]],
    layers: int,
    rank: int,
    seed: int,
    dtype: str = "float32",
) -> None:
    """PEFT's files (``adapter_config.json``, ``adapter_model.safetensors``) for a random
    adapter of ``rank`` on every module of ``shapes`` in every layer."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for name, (k, n) in shapes.items():
            part = "self_attn" if name in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            a = torch.randn(rank, k, generator=gen) * 0.01
            b = torch.randn(n, rank, generator=gen) * 0.01
            tensors[f"{prefix}.lora_A.weight"] = a.to(getattr(torch, dtype))
            tensors[f"{prefix}.lora_B.weight"] = b.to(getattr(torch, dtype))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}
    config["target_modules"] = list(shapes)
    (folder / "adapter_config.json").write_text(json.dumps(config))


def _adapters(args: argparse.Namespace) -> None:
    config = json.loads(Path(args.config).read_text())
    shapes = projection_shapes(config)
    for seed, spec in enumerate(args.specs):
        name, rank = spec.split(":")
        start = time.perf_counter()
        write_adapter(Path(args.dir) / name, shapes, config["num_hidden_layers"], int(rank),
                      seed, args.dtype)  # fmt: skip
        print(f"adapter {name}: rank {rank}, {time.perf_counter() - start:.1f} s", flush=True)


def _post(url: str, body: dict, timeout: float) -> tuple[int, str]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    except OSError as err:  # refused, reset, timed out: no HTTP status
        return 0, repr(err)


def _churn(args: argparse.Namespace) -> None:
    """Each round loads every adapter, then unloads every one; a call counts as failed
    unless it answers 200 with SGLang's ``"success": true``."""
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    adapters = [spec.split("=", 1) for spec in args.adapters]
    calls: list[dict] = []
    deadline = time.monotonic() + args.seconds
    started = time.time()
    while not stop["now"] and time.monotonic() < deadline:
        for op in ("load", "unload"):
            for name, path in adapters:
                if stop["now"]:
                    break
                body = {"lora_name": name}
                if op == "load":
                    body["lora_path"] = path
                start = time.perf_counter()
                status, text = _post(f"{args.url}/{op}_lora_adapter", body, args.timeout)
                latency_ms = (time.perf_counter() - start) * 1000
                ok = status == 200 and '"success":true' in text.replace(" ", "")
                call = {"op": op, "name": name, "status": status, "ok": ok,
                        "latency_ms": round(latency_ms, 2)}  # fmt: skip
                if not ok:
                    call["answer"] = text[:300]
                calls.append(call)
                time.sleep(args.pause)
    summary: dict = {"seconds": round(time.time() - started, 1), "pause_s": args.pause}
    for op in ("load", "unload"):
        mine = [c for c in calls if c["op"] == op]
        latencies = [c["latency_ms"] for c in mine if c["ok"]]
        summary[op] = {
            "calls": len(mine),
            "failures": sum(not c["ok"] for c in mine),
            "median_ms": statistics.median(latencies) if latencies else None,
            "max_ms": max(latencies) if latencies else None,
        }
    Path(args.json_out).write_text(json.dumps({**summary, "calls": calls}, indent=1))
    print("churn:", json.dumps(summary), flush=True)


def _phase(path: Path, num_prompts: int) -> dict:
    """The last bench_serving line of ``path``, its headline numbers and targets."""
    lines = path.read_text().splitlines() if path.exists() else []
    if not lines:
        return {"ran": False, "passed": False, "why": f"no bench_serving output in {path.name}"}
    result = json.loads(lines[-1])
    row = {key: result.get(key) for key in (
        "completed", "duration", "request_throughput", "output_throughput", "median_ttft_ms",
        "p99_ttft_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms", "median_itl_ms",
        "median_tpot_ms", "max_concurrent_requests",
    )}  # fmt: skip
    row["ran"] = True
    row["all_completed"] = result.get("completed") == num_prompts
    return row


def _summary(args: argparse.Namespace) -> None:
    out = Path(args.out)
    phases = {name: _phase(out / f"bench-{name}.jsonl", args.num_prompts) for name in args.phases}
    for name, row in phases.items():
        if name not in TARGETS or not row["ran"]:
            continue
        ttft_max, e2e_max = TARGETS[name]
        row["targets"] = {"median_ttft_ms": ttft_max, "median_e2e_latency_ms": e2e_max}
        row["passed"] = (
            row["all_completed"]
            and row["median_ttft_ms"] < ttft_max
            and row["median_e2e_latency_ms"] < e2e_max
        )
    churn_file = out / "churn.json"
    if "churn" in phases and churn_file.exists():
        churn = json.loads(churn_file.read_text())
        churn.pop("calls")
        phases["churn"]["adapter_calls"] = churn
        calls = churn["load"]["calls"] + churn["unload"]["calls"]
        failures = churn["load"]["failures"] + churn["unload"]["failures"]
        # NOTE: a churn phase whose loop made no call, or whose calls failed, did not
        # measure serving under adapter updates, whatever its latencies
        if phases["churn"].get("passed") and (calls == 0 or failures):
            phases["churn"]["passed"] = False
            phases["churn"]["why"] = f"{failures} of {calls} load/unload calls failed"
    elif "churn" in phases:
        phases["churn"].update(passed=False, why="no churn.json: the load/unload loop did not end")
    judged = [row["passed"] for name, row in phases.items() if name in TARGETS]
    summary = {
        "workload": {"num_prompts": args.num_prompts, "request_rate": args.rate,
                     "input_len": args.input_len, "output_len": args.output_len},
        **json.loads(args.setup),
        "phases": phases,
        "passed": bool(judged) and all(judged),
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    adapters = sub.add_parser("adapters", help="write random PEFT adapters")
    adapters.add_argument("config", help="the base model's config.json")
    adapters.add_argument("dir")
    adapters.add_argument("specs", nargs="+", metavar="NAME:RANK")
    adapters.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    churn = sub.add_parser("churn", help="load and unload adapters until SIGTERM")
    churn.add_argument("url")
    churn.add_argument("adapters", nargs="+", metavar="NAME=PATH")
    churn.add_argument("--json-out", required=True)
    churn.add_argument("--seconds", type=float, default=600.0)
    churn.add_argument("--pause", type=float, default=0.0, help="seconds after each call")
    churn.add_argument("--timeout", type=float, default=60.0, help="one call's limit")
    summary = sub.add_parser("summary", help="the phases against the targets")
    summary.add_argument("out")
    summary.add_argument("--phases", nargs="+", default=["base", "lora", "churn"])
    summary.add_argument("--num-prompts", type=int, default=400)
    summary.add_argument("--rate", type=float, default=8.0)
    summary.add_argument("--input-len", type=int, default=256)
    summary.add_argument("--output-len", type=int, default=256)
    summary.add_argument("--setup", default="{}", help="a JSON object copied into the summary")
    args = parser.parse_args()
    {"adapters": _adapters, "churn": _churn, "summary": _summary}[args.command](args)


if __name__ == "__main__":
    main()
