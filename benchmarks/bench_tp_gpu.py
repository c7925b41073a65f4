"""Decode step under tensor parallelism on several GPUs, and the all-reduce's share of it.

One process per rank (NCCL, GPU ``r`` for rank ``r``), each building the engine on a
shipped dummy config (bf16, CUDA graphs) and running the same schedule: a batch of
``bs`` prompts of ``--context`` tokens prefilled, then ``--steps`` decode steps timed
(scheduler included, as ``bench_gpu.py decode`` does at one rank). Then, on the same
ranks, the collectives one decode step issues, alone: ``2 x layers`` all-reduces of
``[bs, hidden]`` bf16 (after attention and after the MLP), eager and captured in one CUDA
graph as the decode step runs them. Rank 0's figures are reported.

    python -P benchmarks/bench_tp_gpu.py --model llama-3.1-70b --tp 4 --json-out out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import socket
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # bench_gpu beside this file (-P omits it)

PEAK_BW = {"H100": 3.35e12, "H200": 4.8e12}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _decode_rows(engine: Any, batch_sizes: list[int], context: int, steps: int) -> list[dict]:
    from bench_gpu import admit_decode_batch, time_cuda

    rng = random.Random(0)
    rows = []
    for bs in batch_sizes:
        reqs = admit_decode_batch(engine, bs, context, steps, rng)
        step_s = time_cuda(engine.scheduler.step, steps)
        rows.append({"batch": bs, "step_ms": step_s * 1e3, "tokens_per_s": bs / step_s})
        for req in reqs:
            engine.scheduler.abort_request(req.rid)
        assert engine.is_memory_free()
    return rows


def _collective_rows(group: Any, hidden: int, layers: int, batch_sizes: list[int]) -> list[dict]:
    """The decode step's all-reduces alone: eager, and captured in one CUDA graph."""
    import torch
    from bench_gpu import time_cuda

    rows = []
    for bs in batch_sizes:
        x = torch.randn(bs, hidden, dtype=torch.bfloat16, device="cuda")
        count = 2 * layers

        def step(x: torch.Tensor = x, count: int = count) -> None:
            for _ in range(count):
                group.all_reduce(x)

        eager_s = time_cuda(step, 20)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm the communicator on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph_s = time_cuda(graph.replay, 20)
        rows.append(
            {
                "batch": bs,
                "all_reduces_per_step": count,
                "eager_ms_per_step": eager_s * 1e3,
                "graph_ms_per_step": graph_s * 1e3,
                "graph_us_per_all_reduce": graph_s / count * 1e6,
            }
        )
    return rows


def _rank(rank: int, size: int, addr: str, args: dict, results: Any) -> None:
    import torch

    from kvflow.runtime.distributed import init_tp_group
    from kvflow.runtime.engine import Engine

    try:
        device = f"cuda:{rank}"
        group = init_tp_group(rank, size, addr, device) if size > 1 else None
        if group is None:
            torch.cuda.set_device(device)
        batch_sizes = args["batch_sizes"]
        engine = Engine(
            args["model"],
            tp=group,
            tp_size=size,
            load_format="dummy",
            dtype="bfloat16",
            device=device,
            skip_tokenizer_init=True,
            max_running_requests=max(batch_sizes),
            cuda_graph_max_bs=max(batch_sizes),
            chunked_prefill_size=16384,
            max_prefill_tokens=16384,
        )
        mc = engine.runner.model_config
        weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
        kv_heads = engine.runner.heads.num_kv_heads
        kv_per_token = 2 * mc.num_layers * kv_heads * mc.head_dim * 2
        decode = _decode_rows(engine, batch_sizes, args["context"], args["steps"])
        peak = next((bw for k, bw in PEAK_BW.items() if k in torch.cuda.get_device_name()), 3.35e12)
        for row in decode:
            moved = weights + row["batch"] * (args["context"] + 8) * kv_per_token
            row["hbm_fraction_per_gpu"] = moved / (row["step_ms"] / 1e3) / peak
        collectives = (
            _collective_rows(group, mc.hidden_size, mc.num_layers, batch_sizes) if group else []
        )
        results.put(
            (
                rank,
                {
                    "decode": decode,
                    "collectives": collectives,
                    "weight_bytes_per_gpu": weights,
                    "kv_heads_per_gpu": kv_heads,
                },
            )
        )
    except BaseException as err:
        results.put((rank, {"error": f"{type(err).__name__}: {err}"}))
        raise


def run(model: str, tp: int, batch_sizes: list[int], context: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = {"model": model, "batch_sizes": batch_sizes, "context": context, "steps": steps}
    addr = f"127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, tp, addr, args, results)) for r in range(tp)]
    for proc in procs:
        proc.start()
    try:
        reports = dict(results.get(timeout=900) for _ in procs)
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    errors = {r: rep["error"] for r, rep in reports.items() if "error" in rep}
    if errors:
        raise SystemExit(f"ranks failed: {errors}")
    return {"model": model, "tp": tp, "context": context, "steps": steps, **reports[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="a shipped dummy config")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    report = run(args.model, args.tp, args.batch_sizes, args.context, args.steps)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
