"""The cost of tensor parallelism per decode step on CPU: ``--tp-size 2`` (gloo, a process
per rank) against one rank, on the same random-weight Llama-shaped model.

Each configuration runs in fresh processes: every rank builds an engine on the model,
warms up, prefills a batch (``max_new_tokens`` 1), then runs the same batch to
``--output-len`` tokens; (decode run - prefill run) / (output-len - 1) is the time of one
decode step of the whole batch. Rank 0's figure is reported (every rank runs the same
steps). On a 2-core machine this measures what the all-reduces and the split cost when
each rank has one core; it is not a speed claim: the GPU run is where TP buys speed.

    python -P benchmarks/bench_tp.py --out benchmarks/results/tp-cpu.md
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

# Llama-shaped (GQA, SwiGLU, untied head): ~60M parameters, float32.
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank(rank: int, size: int, addr: str, config: str, args: dict, results: Any) -> None:
    import torch

    from kvflow.runtime.distributed import init_tp_group
    from kvflow.runtime.engine import Engine

    group = init_tp_group(rank, size, addr, "cpu") if size > 1 else None
    engine = Engine(
        config,
        tp=group,
        tp_size=size,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        cpu_threads=args["threads"],
    )
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 32000, (args["input_len"],), generator=g).tolist()
        for _ in range(args["batch"])
    ]

    def timed(new_tokens: int) -> float:
        engine.flush_cache()
        params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
        began = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        return time.perf_counter() - began

    timed(4)  # warm-up
    prefill = min(timed(1) for _ in range(2))
    decode = min(timed(args["output_len"]) for _ in range(2))
    if rank == 0:
        step = (decode - prefill) / (args["output_len"] - 1)
        results.put({"prefill_s": prefill, "decode_step_ms": step * 1e3})


def measure(size: int, threads: int, config: str, args: dict) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    addr = f"127.0.0.1:{_free_port()}"
    run = {**args, "threads": threads}
    procs = [
        ctx.Process(target=_rank, args=(r, size, addr, config, run, results)) for r in range(size)
    ]
    for proc in procs:
        proc.start()
    result = results.get(timeout=1800)
    for proc in procs:
        proc.join(60)
    return {"tp_size": size, "threads_per_rank": threads, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=33)
    parser.add_argument("--out", type=Path)
    ns = parser.parse_args()
    args = {"batch": ns.batch, "input_len": ns.input_len, "output_len": ns.output_len}
    folder = Path(tempfile.mkdtemp(prefix="bench-tp-"))
    (folder / "config.json").write_text(json.dumps(MODEL))
    config = str(folder / "config.json")
    cores = len(os.sched_getaffinity(0))
    load_before = os.getloadavg()
    runs = [
        measure(1, 1, config, args),
        measure(1, cores, config, args),
        measure(2, max(1, cores // 2), config, args),
    ]
    base_1, base_all, tp2 = runs
    ratios = {
        "tp2_vs_tp1_same_threads_per_rank": tp2["decode_step_ms"] / base_1["decode_step_ms"],
        "tp2_vs_tp1_all_cores": tp2["decode_step_ms"] / base_all["decode_step_ms"],
    }
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {cores} cores",
        # other processes compete for the cores: the 1-minute load before and after
        "load_average_1m": [load_before[0], os.getloadavg()[0]],
        "model": MODEL,
        "workload": args,
        "runs": runs,
        "ratios": ratios,
    }
    print(json.dumps(report, indent=2))
    if ns.out:
        rows = "\n".join(
            f"| {r['tp_size']} | {r['threads_per_rank']} | {r['decode_step_ms']:.1f} "
            f"| {r['prefill_s']:.2f} |"
            for r in runs
        )
        ns.out.write_text(
            f"""# Tensor parallelism on CPU: cost per decode step

Command: `python -P benchmarks/bench_tp.py --out {ns.out}` (commit before it: see git log).
Machine: {report["machine"]}; 1-minute load average {report["load_average_1m"][0]:.2f}
before, {report["load_average_1m"][1]:.2f} after (above 0 means other processes took core
time too: the figures are then upper bounds). Model: a random-weight Llama shape (hidden
{MODEL["hidden_size"]}, {MODEL["num_hidden_layers"]} layers, {MODEL["num_attention_heads"]}
heads, {MODEL["num_key_value_heads"]} KV heads, vocabulary {MODEL["vocab_size"]}), float32.
Workload: a batch of {ns.batch} prompts of {ns.input_len} tokens, {ns.output_len} output
tokens each (greedy, EOS ignored); the decode step is (run to {ns.output_len} tokens - run
to 1 token) / {ns.output_len - 1}, best of two.

| tp size | threads per rank | decode step (ms, whole batch) | prefill (s) |
|---:|---:|---:|---:|
{rows}

TP=2 / TP=1 at one thread per rank: **{ratios["tp2_vs_tp1_same_threads_per_rank"]:.2f}x**
the step time; TP=2 (one core each) / TP=1 with every core:
**{ratios["tp2_vs_tp1_all_cores"]:.2f}x**.

What this says: on this machine a rank is a process with its own core, and each decode
step adds two all-reduces per layer (after attention and after the MLP), an all-gather of
the logits and a broadcast of the sampled ids, over gloo on loopback, plus the scheduler's
per-step broadcast of the messages; the matmuls split in two. It is the price of the
collectives on CPU, not a speed claim: tensor parallelism is for models that do not fit one
GPU, and its speed is measured on several GPUs (benchmarks/gpu_http_run.sh with `TP=`).

Raw JSON:

```json
{json.dumps(report, indent=2)}
```
"""
        )


if __name__ == "__main__":
    main()
