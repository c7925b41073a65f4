"""Multi-LoRA decode on the GPU: Llama-3.1-8B shapes (random bf16 weights), four random
rank-16 adapters on all seven projections, output tok/s of greedy decoding (short
prompts, 128 new tokens, EOS ignored) through ``Engine.generate`` at batch 1 and 32:

- base: no ``--enable-lora`` (the reference);
- lora-graphs base-only: ``--enable-lora``, decode CUDA graphs, no request on an adapter
  (what serving the base model costs once LoRA is on);
- lora-graphs mixed: the batch's requests cycle over the four adapters;
- lora-eager mixed: the same with ``--disable-cuda-graph`` (what LoRA cost before its
  decode ran in graphs).

Part ``kernels``: the LoRA kernels against a per-request loop. For each projection of the
8B shapes (q/k/v/o/gate/up/down, one PEFT module each) at rank 16 and 64, one decode step's
delta ``out += (x @ A[slot].T) @ B[slot].T`` at batch 1, 8, 32 and 128, each request its
own one-row segment on one of four slots (the decode graphs' layout): ``lora_shrink`` +
``lora_expand`` (kvflow.kernels) against ``lora_shrink_ref`` + ``lora_expand_ref`` (one
torch matmul per request, the layout known on the host), microseconds per call from CUDA
events around ``--kernel-iters`` back-to-back calls (host launch time counts, as in an
eager step), and the kernels' largest difference from the loop.

    PYTHONPATH=benchmarks python -P benchmarks/bench_lora_gpu.py [engine] [kernels] \
        --json-out lora-gpu.json --md-out lora-kernels.md
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from bench_gpu import _driver_version, gpu_name, make_engine
from lora_serving import write_adapter

MODEL = "llama-3.1-8b"
MODULES = {  # PEFT module -> (input width, output rows) in Llama-3.1-8B
    "q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024),
    "o_proj": (4096, 4096), "gate_proj": (4096, 14336), "up_proj": (4096, 14336),
    "down_proj": (14336, 4096),
}  # fmt: skip
ADAPTERS = ("a", "b", "c", "d")
KERNEL_BATCHES = (1, 8, 32, 128)
KERNEL_RANKS = (16, 64)
KERNEL_SLOTS = 4


def decode_rate(engine, bs: int, adapters: list[str | None], new_tokens: int = 128) -> float:
    """Output tok/s of ``bs`` 32-token prompts decoding ``new_tokens`` each (a warm-up run
    first, so graphs, kernels and adapter slots are warm)."""
    prompts = [[1000 + 7 * i + j for j in range(32)] for i in range(bs)]
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    paths = [adapters[i % len(adapters)] for i in range(bs)]
    engine.generate(input_ids=prompts, sampling_params=params, lora_path=paths)
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=params, lora_path=paths)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    # NOTE: a request that failed (a kernel that does not launch) ends at once: without
    # this check its run reported 30,000 tok/s
    short = [r for r in results if len(r.output_ids) != new_tokens]
    if short:
        raise RuntimeError(
            f"{len(short)} of {bs} requests ended short of {new_tokens} tokens: "
            f"{short[0].finish_reason}"
        )
    return bs * new_tokens / seconds


def time_us(fn, iters: int, cuda: bool) -> float:
    """Microseconds per call of ``fn`` over ``iters`` back-to-back calls after three warm
    ones: CUDA events around the loop on a GPU, the wall clock elsewhere."""
    for _ in range(3):
        fn()
    if not cuda:
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e6 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def step_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, iters: int) -> dict:
    """One decode step's delta ``out += (x @ A[slot].T) @ B[slot].T`` for ``x`` ``[batch,
    K]``, each request its own one-row segment (the decode graphs' layout) on slot ``i %
    slots``: the segmented kernels' and the per-request loop's microseconds per call, and
    their largest difference."""
    from kvflow.kernels import lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref

    bs, n = x.shape[0], b.shape[1]
    indptr_host = torch.arange(bs + 1, dtype=torch.int32)
    slots_host = torch.arange(bs, dtype=torch.int32) % a.shape[0]
    indptr, slots = indptr_host.to(x.device), slots_host.to(x.device)
    out = torch.zeros(bs, n, device=x.device, dtype=x.dtype)

    def kernels(out: torch.Tensor = out) -> torch.Tensor:
        return lora_expand(lora_shrink(x, a, indptr, slots, 1), b, out, indptr, slots, 1)

    def loop(out: torch.Tensor = out) -> torch.Tensor:  # the layout known on the host
        h = lora_shrink_ref(x, a, indptr_host, slots_host)
        return lora_expand_ref(h, b, out, indptr_host, slots_host)

    got, want = kernels(torch.zeros_like(out)), loop(torch.zeros_like(out))
    kernel_us, loop_us = time_us(kernels, iters, x.is_cuda), time_us(loop, iters, x.is_cuda)
    return {
        "kernel_us": kernel_us, "loop_us": loop_us, "loop_over_kernel": loop_us / kernel_us,
        "max_abs_diff": (got.float() - want.float()).abs().max().item(),
    }  # fmt: skip


def kernel_rows(
    shapes: dict[str, tuple[int, int]],
    ranks: tuple[int, ...] = KERNEL_RANKS,
    batches: tuple[int, ...] = KERNEL_BATCHES,
    iters: int = 200,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """:func:`step_delta` for each rank, projection (``shapes``: module -> (input width,
    output rows)) and batch size, over ``KERNEL_SLOTS`` random adapters."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for rank in ranks:
        for name, (k, n) in shapes.items():
            a = (torch.randn(KERNEL_SLOTS, rank, k, generator=gen) * k**-0.5).to(device, dtype)
            b = (torch.randn(KERNEL_SLOTS, n, rank, generator=gen) * rank**-0.5).to(device, dtype)
            for bs in batches:
                x = torch.randn(bs, k, generator=gen).to(device, dtype)
                row = {"rank": rank, "projection": name, "batch": bs, **step_delta(x, a, b, iters)}
                rows.append(row)
                print(f"rank {rank} {name} batch {bs}: kernels {row['kernel_us']:.1f} us, "
                      f"loop {row['loop_us']:.1f} us", flush=True)  # fmt: skip
    return rows


def kernel_markdown(rows: list[dict]) -> str:
    """The kernel rows as a table, with each (rank, batch)'s sum over the projections (one
    layer's LoRA deltas)."""
    lines = [
        "| rank | batch | projection | kernels us | per-request loop us | loop / kernels | max abs diff |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    keys = sorted({(r["rank"], r["batch"]) for r in rows})
    for rank, bs in keys:
        mine = [r for r in rows if (r["rank"], r["batch"]) == (rank, bs)]
        for r in mine:
            lines.append(
                f"| {rank} | {bs} | {r['projection']} | {r['kernel_us']:.1f} | {r['loop_us']:.1f} "
                f"| {r['loop_over_kernel']:.2f}x | {r['max_abs_diff']:.2g} |"
            )
        kernel_us, loop_us = sum(r["kernel_us"] for r in mine), sum(r["loop_us"] for r in mine)
        lines.append(
            f"| {rank} | {bs} | **all {len(mine)}** | **{kernel_us:.1f}** | **{loop_us:.1f}** "
            f"| **{loop_us / kernel_us:.2f}x** | |"
        )
    return "\n".join(lines) + "\n"


def engine_rows(sizes: list[int], rows: list[dict], save=lambda: None) -> None:
    """The four engine runs of the module's docstring at each batch size, appended to
    ``rows``; ``save`` after each."""
    root = Path(tempfile.mkdtemp(prefix="kvflow-lora-bench-"))
    for seed, name in enumerate(ADAPTERS):
        write_adapter(root / name, MODULES, layers=32, rank=16, seed=seed)
    lora = dict(
        enable_lora=True,
        lora_paths=tuple(f"{n}={root / n}" for n in ADAPTERS),
        max_loras_per_batch=len(ADAPTERS),
    )
    runs = [
        ("base", {}, [None]),
        ("lora-graphs base-only", lora, [None]),
        ("lora-graphs mixed", lora, list(ADAPTERS)),
        ("lora-eager mixed", {**lora, "disable_cuda_graph": True}, list(ADAPTERS)),
    ]
    for label, kwargs, adapters in runs:
        engine = make_engine(MODEL, max_running_requests=max(sizes), **kwargs)
        for bs in sizes:
            rate = decode_rate(engine, bs, adapters)
            rows.append({"run": label, "batch": bs, "output_tok_s": rate})
            print(label, bs, f"{rate:.1f} tok/s", flush=True)
            save()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    base = {r["batch"]: r["output_tok_s"] for r in rows if r["run"] == "base"}
    for r in rows:
        r["vs_base"] = r["output_tok_s"] / base[r["batch"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", metavar="PART", help="engine, kernels (default: both)")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--md-out", type=Path, default=None, help="the kernels' table")
    parser.add_argument("--batch-sizes", default="1,32", help="the engine part's")
    parser.add_argument("--kernel-iters", type=int, default=200)
    args = parser.parse_args()
    args.parts = args.parts or ["engine", "kernels"]
    if set(args.parts) - {"engine", "kernels"}:
        parser.error(f"parts are engine and kernels, got {args.parts}")
    results: dict = {"gpu": gpu_name(), "torch": torch.__version__, "driver": _driver_version()}

    def save() -> None:  # after every run: a call cut short keeps what it measured
        if args.json_out:
            args.json_out.write_text(json.dumps(results, indent=1))

    if "kernels" in args.parts:
        results["kernel_rows"] = kernel_rows(MODULES, iters=args.kernel_iters)
        table = kernel_markdown(results["kernel_rows"])
        print(table)
        if args.md_out:
            args.md_out.write_text(table)
        save()
    if "engine" in args.parts:
        results["rows"] = []
        engine_rows([int(b) for b in args.batch_sizes.split(",")], results["rows"], save)
        print(json.dumps(results["rows"], indent=1))
        save()


if __name__ == "__main__":
    main()
