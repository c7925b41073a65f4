"""Multi-LoRA decode on the GPU: Llama-3.1-8B shapes (random bf16 weights), four random
rank-16 adapters on all seven projections, output tok/s of greedy decoding (short
prompts, 128 new tokens, EOS ignored) through ``Engine.generate`` at batch 1 and 32:

- base: no ``--enable-lora`` (the reference);
- lora-graphs base-only: ``--enable-lora``, decode CUDA graphs, no request on an adapter
  (what serving the base model costs once LoRA is on);
- lora-graphs mixed: the batch's requests cycle over the four adapters;
- lora-eager mixed: the same with ``--disable-cuda-graph`` (what LoRA cost before its
  decode ran in graphs).

``--adapter-ranks`` sets the four adapters' ranks (default 16 each; issue 28's serving
bar: 16,64,16,64).

Each engine run also times eager prefills (``--prefill-tokens`` each, 256 by default, one
new token, prompts no cache holds): milliseconds per ``Engine.generate`` of 1 and of 2
requests, the median of 8; with adapters each way an eager batch can take (as
``kvflow.runtime.lora.batch`` chooses, the masked matmuls, Triton's segmented kernels).
With ``--profile``, the host's busiest functions (cProfile) in 2-request prefills too.

Part ``kernels``: the LoRA kernels in the decode graphs' layout against the layout before
and a per-request loop. For each merged layer of the 8B shapes (qkv, o, gate_up, down, as
the graphs run them), one decode step's delta ``out += (x @ A[slot].T) @ B[slot].T`` at
batch 1, 8, 32 and 128, request ``i`` on slot ``i % 4``, with four slots of rank 16, of
rank 64, and of width 64 holding adapters of rank 16, 64, 16, 64 (issue 28's serving bar):

- grouped: ``lora_shrink`` + ``lora_expand`` (kvflow.kernels) with the rows grouped by
  slot (one segment per slot plus the base model's, rows permuted, the grid sized for the
  whole batch) and each adapter read at its own rank, as the decode graphs now run them;
- one-row segments: the same kernels with each request its own one-row segment and every
  slot at its full width (the graphs' layout before);
- per-request loop: ``lora_shrink_ref`` + ``lora_expand_ref`` (torch matmuls per request
  and shard, the layout known on the host);

microseconds per call from CUDA events around ``--kernel-iters`` back-to-back calls (host
launch time counts, as in an eager step; inside a graph it does not), and each one's
largest difference from the loop.

    PYTHONPATH=benchmarks python -P benchmarks/bench_lora_gpu.py [engine] [kernels] \
        --json-out lora-gpu.json --md-out lora-kernels.md
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_gpu import _driver_version, gpu_name, make_engine, random_ids
from lora_serving import write_adapter

MODEL = "llama-3.1-8b"
MODULES = {  # PEFT module -> (input width, output rows) in Llama-3.1-8B
    "q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024),
    "o_proj": (4096, 4096), "gate_proj": (4096, 14336), "up_proj": (4096, 14336),
    "down_proj": (14336, 4096),
}  # fmt: skip
ADAPTERS = ("a", "b", "c", "d")
# kvflow's merged layers of Llama-3.1-8B, as the decode graphs run them: name -> (input
# width, each shard's output rows)
LAYERS = {
    "qkv_proj": (4096, (4096, 1024, 1024)), "o_proj": (4096, (4096,)),
    "gate_up_proj": (4096, (14336, 14336)), "down_proj": (14336, (4096,)),
}  # fmt: skip
KERNEL_BATCHES = (1, 8, 32, 128)
RUN_KEYS = ("base", "base-only", "mixed", "eager")  # engine_rows' runs, in their order
# name -> (the slots' width, --max-lora-rank; each of the four slots' adapter rank): the
# last is issue 28's serving bar (a, c rank 16; b, d rank 64)
RANK_MIXES = {"16": (16, [16] * 4), "64": (64, [64] * 4), "16+64": (64, [16, 64, 16, 64])}


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


def prefill_ms(
    engine, requests: int, tokens: int, adapters: list[str | None], reps: int = 8
) -> float:
    """Median wall milliseconds of ``Engine.generate`` of ``requests`` fresh prompts of
    ``tokens`` tokens and one new token (after two warm ones): an eager prefill step plus
    the scheduler's round trip."""
    params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    paths = [adapters[i % len(adapters)] for i in range(requests)]
    times, vocab = [], engine.runner.model_config.vocab_size
    rng = random.Random(requests * 1000 + reps)
    for _ in range(reps + 2):
        prompts = [random_ids(rng, tokens, vocab) for _ in range(requests)]  # (none cached)
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params, lora_path=paths)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def prefill_rows(
    engine, label: str, adapters: list[str | None], tokens: int, profile: bool
) -> list[dict]:
    """:func:`prefill_ms` at 1 and 2 requests; with adapters, each way an eager batch can
    run its LoRA: as ``kvflow.runtime.lora.batch`` chooses (a segment: two matmuls;
    more: the masked matmuls), the masked matmuls for every batch, and Triton's segmented
    kernels. With ``profile``, :func:`host_profile` for each."""
    from kvflow.runtime.lora import batch as lora_batch

    chosen = (lora_batch.LOOP_SEGMENTS, lora_batch.MASKED_ROWS)
    ways = [("", chosen)]
    if any(adapters):
        ways += [(" masked", (0, chosen[1])), (" triton", (0, 0))]
    rows = []
    for suffix, (loop, masked) in ways:
        lora_batch.LOOP_SEGMENTS, lora_batch.MASKED_ROWS = loop, masked
        try:
            for requests in (1, 2):
                ms = prefill_ms(engine, requests, tokens, adapters)
                rows.append({"run": label + suffix, "prefill_requests": requests,
                             "prefill_tokens": tokens, "prefill_ms": ms})  # fmt: skip
                print(f"{label}{suffix} prefill {requests}x{tokens}: {ms:.2f} ms", flush=True)
            if profile:
                profiled = host_profile(engine, tokens, adapters)
                rows.append({"run": label + suffix, "prefill_profile": profiled})
        finally:
            lora_batch.LOOP_SEGMENTS, lora_batch.MASKED_ROWS = chosen
    return rows


def host_profile(engine, tokens: int, adapters: list[str | None]) -> dict:
    """Where a 2-request prefill's time goes: cProfile's 25 functions with the most own
    time (Python launchers, Triton's among them, and torch's operators as the host spends
    them), then torch.profiler's GPU kernels (their summed device time a prefill, against
    its wall time: a prefill whose kernels sum to much less is bound by the host)."""
    from torch.profiler import ProfilerActivity, profile

    profiler = cProfile.Profile()
    profiler.enable()
    prefill_ms(engine, 2, tokens, adapters, reps=1)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    print("\n".join(lines), flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = prefill_ms(engine, 2, tokens, adapters, reps=1)  # NOTE: three prefills
    kernels = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total:
            kernels.append({"kernel": event.key[:100], "count": event.count // 3,
                            "us_per_prefill": total / 3})  # fmt: skip
    kernels.sort(key=lambda k: -k["us_per_prefill"])
    busy = sum(k["us_per_prefill"] for k in kernels) / 1e3
    print(f"  GPU kernels {busy:.2f} ms a prefill (wall under the profiler {wall:.2f} ms)")
    for k in kernels[:12]:
        print(f"  {k['us_per_prefill']:9.1f} us {k['count']:6d}x  {k['kernel']}", flush=True)
    return {"cprofile": lines, "gpu_ms": busy, "wall_ms": wall, "kernels": kernels[:25]}


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


def step_delta(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    shard_rows: tuple[int, ...],
    slot_ranks: list[int],
    iters: int,
) -> dict:
    """One decode step's delta ``out += (x @ A[slot].T) @ B[slot].T`` of one merged layer
    (``shard_rows``: its shards' output rows) for ``x`` ``[batch, K]``, request ``i`` on slot
    ``i % slots`` (adapters interleaved, as requests arrive), each slot's adapter at its rank
    of ``slot_ranks``: microseconds per call of the kernels in the decode graphs' grouped
    layout (one segment per slot, rows permuted, each adapter at its rank), of the kernels
    with each request its own one-row segment at the slots' full width (the graphs' layout
    before), and of the per-request loop; and each one's largest difference from the loop."""
    from kvflow.kernels import lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref
    from kvflow.runtime.lora.graph import group_rows

    bs, num_slots, n = x.shape[0], a.shape[0], b.shape[1]
    device, shards = x.device, len(shard_rows)
    row_slots = [i % num_slots for i in range(bs)]
    groups = group_rows(row_slots, bs, num_slots)
    grouped = {
        "seg": (
            torch.tensor(groups.seg_indptr, dtype=torch.int32, device=device),
            torch.tensor([*range(num_slots), -1], dtype=torch.int32, device=device),
        ),
        "row_order": torch.tensor(groups.row_order, dtype=torch.int32, device=device),
        "slot_ranks": torch.tensor(slot_ranks, dtype=torch.int32, device=device),
    }
    one_row_host = (
        torch.arange(bs + 1, dtype=torch.int32),
        torch.tensor(row_slots, dtype=torch.int32),
    )
    one_row = tuple(t.to(device) for t in one_row_host)
    ranks_host = torch.tensor(slot_ranks, dtype=torch.int32)
    out = torch.zeros(bs, n, device=device, dtype=x.dtype)

    def grouped_kernels(out: torch.Tensor = out) -> torch.Tensor:
        layout = {"row_order": grouped["row_order"], "slot_ranks": grouped["slot_ranks"]}
        h = lora_shrink(x, a, *grouped["seg"], bs, num_shards=shards, **layout)
        return lora_expand(h, b, out, *grouped["seg"], bs, shard_rows=shard_rows, **layout)

    def one_row_kernels(out: torch.Tensor = out) -> torch.Tensor:  # every slot at full width
        h = lora_shrink(x, a, *one_row, 1)
        return lora_expand(h, b, out, *one_row, 1)

    def loop(out: torch.Tensor = out) -> torch.Tensor:  # the layout known on the host
        h = lora_shrink_ref(x, a, *one_row_host, slot_ranks=ranks_host, num_shards=shards)
        return lora_expand_ref(
            h, b, out, *one_row_host, slot_ranks=ranks_host, shard_rows=shard_rows
        )

    want = loop(torch.zeros_like(out)).float()
    row: dict = {}
    for label, fn in (("grouped", grouped_kernels), ("one_row", one_row_kernels), ("loop", loop)):
        got = fn(torch.zeros_like(out)).float()
        row[f"{label}_us"] = time_us(fn, iters, x.is_cuda)
        row[f"{label}_max_abs_diff"] = (got - want).abs().max().item()
    row["one_row_over_grouped"] = row["one_row_us"] / row["grouped_us"]
    row["loop_over_grouped"] = row["loop_us"] / row["grouped_us"]
    return row


def _layer_weights(
    gen: torch.Generator, k: int, shard_rows: tuple[int, ...], width: int, ranks: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A merged layer's slots as :class:`~kvflow.runtime.lora.LoraLinear` holds them:
    ``A`` ``[slots, shards * width, K]``, ``B`` ``[slots, N, shards * width]`` block-diagonal,
    zeros past each slot's rank."""
    shards, slots = len(shard_rows), len(ranks)
    a = torch.zeros(slots, shards * width, k)
    b = torch.zeros(slots, sum(shard_rows), shards * width)
    for slot, rank in enumerate(ranks):
        first_row = 0
        for shard, rows in enumerate(shard_rows):
            cols = slice(shard * width, shard * width + rank)
            a[slot, cols] = torch.randn(rank, k, generator=gen) * k**-0.5
            b[slot, first_row : first_row + rows, cols] = (
                torch.randn(rows, rank, generator=gen) * rank**-0.5
            )
            first_row += rows
    return a, b


def kernel_rows(
    layers: dict[str, tuple[int, tuple[int, ...]]] = LAYERS,
    rank_mixes: dict[str, tuple[int, list[int]]] = RANK_MIXES,
    batches: tuple[int, ...] = KERNEL_BATCHES,
    iters: int = 200,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """:func:`step_delta` for each rank mix (name -> (the slots' width, each slot's rank)),
    merged layer (``layers``: name -> (input width, its shards' output rows)) and batch."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for mix, (width, ranks) in rank_mixes.items():
        for name, (k, shard_rows) in layers.items():
            a, b = (t.to(device, dtype) for t in _layer_weights(gen, k, shard_rows, width, ranks))
            for bs in batches:
                x = torch.randn(bs, k, generator=gen).to(device, dtype)
                row = {"ranks": mix, "layer": name, "batch": bs,
                       **step_delta(x, a, b, shard_rows, ranks, iters)}  # fmt: skip
                rows.append(row)
                print(f"ranks {mix} {name} batch {bs}: grouped {row['grouped_us']:.1f} us, "
                      f"one-row {row['one_row_us']:.1f} us, loop {row['loop_us']:.1f} us",
                      flush=True)  # fmt: skip
    return rows


def kernel_markdown(rows: list[dict]) -> str:
    """The kernel rows as a table, with each (rank mix, batch)'s sum over the layers (one
    decoder layer's LoRA deltas)."""
    lines = [
        "| ranks | batch | layer | grouped us | one-row segments us | per-request loop us "
        "| one-row / grouped | max abs diff (grouped) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    keys = sorted({(r["ranks"], r["batch"]) for r in rows}, key=lambda key: (key[0], key[1]))
    for mix, bs in keys:
        mine = [r for r in rows if (r["ranks"], r["batch"]) == (mix, bs)]
        for r in mine:
            lines.append(
                f"| {mix} | {bs} | {r['layer']} | {r['grouped_us']:.1f} | {r['one_row_us']:.1f} "
                f"| {r['loop_us']:.1f} | {r['one_row_over_grouped']:.2f}x "
                f"| {r['grouped_max_abs_diff']:.2g} |"
            )
        total = {key: sum(r[f"{key}_us"] for r in mine) for key in ("grouped", "one_row", "loop")}
        lines.append(
            f"| {mix} | {bs} | **all {len(mine)}** | **{total['grouped']:.1f}** "
            f"| **{total['one_row']:.1f}** | **{total['loop']:.1f}** "
            f"| **{total['one_row'] / total['grouped']:.2f}x** | |"
        )
    return "\n".join(lines) + "\n"


def engine_rows(
    sizes: list[int],
    rows: list[dict],
    ranks: list[int],
    save=lambda: None,
    keys: list[str] | None = None,
    profile: bool = False,
    prefill_tokens: int = 256,
) -> None:
    """The engine runs of the module's docstring (``keys``: some of them, None: all) at each
    batch size, appended to ``rows`` (the adapters of ``ranks``); ``save`` after each. With
    ``profile``, each run's kernels at the largest batch too (:func:`kernel_profile`)."""
    root = Path(tempfile.mkdtemp(prefix="kvflow-lora-bench-"))
    for seed, (name, rank) in enumerate(zip(ADAPTERS, ranks, strict=True)):
        write_adapter(root / name, MODULES, layers=32, rank=rank, seed=seed)
    lora = dict(
        enable_lora=True,
        lora_paths=tuple(f"{n}={root / n}" for n in ADAPTERS),
        max_loras_per_batch=len(ADAPTERS),
    )
    runs = dict(zip(RUN_KEYS, [  # label, engine arguments, the requests' adapters
        ("base", {}, [None]),
        ("lora-graphs base-only", lora, [None]),
        ("lora-graphs mixed", lora, list(ADAPTERS)),
        ("lora-eager mixed", {**lora, "disable_cuda_graph": True}, list(ADAPTERS)),
    ], strict=True))  # fmt: skip
    for key in keys or RUN_KEYS:
        label, kwargs, adapters = runs[key]
        engine = make_engine(MODEL, max_running_requests=max(sizes), **kwargs)
        if key in ("base", "mixed"):
            rows.extend(prefill_rows(engine, label, adapters, prefill_tokens, profile))
            save()
        for bs in sizes:
            rate = decode_rate(engine, bs, adapters)
            rows.append({"run": label, "batch": bs, "output_tok_s": rate, "ranks": ranks})
            print(label, bs, f"{rate:.1f} tok/s", flush=True)
            save()
        if profile:
            rows.append({"run": label, "batch": max(sizes), "ranks": ranks,
                         "kernels": kernel_profile(engine, max(sizes), adapters)})  # fmt: skip
            save()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    base = {
        r["batch"]: r["output_tok_s"] for r in rows if r["run"] == "base" and "output_tok_s" in r
    }
    for r in rows:
        if "output_tok_s" in r and r["batch"] in base:
            r["vs_base"] = r["output_tok_s"] / base[r["batch"]]


def kernel_profile(engine, bs: int, adapters: list[str | None], new_tokens: int = 32) -> list[dict]:
    """The GPU kernels of :func:`decode_rate`'s two runs of ``bs`` requests and
    ``new_tokens`` tokens (its warm-up and its timed run, under torch.profiler: kernels
    inside CUDA graphs are reported one by one): the 30 with the most device time, each
    with its count and microseconds per decode step (``2 * new_tokens`` steps; the two
    prefills are in it too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_rate(engine, bs, adapters, new_tokens)
    steps = 2 * new_tokens
    events = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total:
            events.append({"kernel": event.key[:120], "count": event.count,
                           "us_per_step": total / steps})  # fmt: skip
    events.sort(key=lambda e: -e["us_per_step"])
    for e in events[:30]:
        print(f"{e['us_per_step']:9.1f} us/step {e['count']:7d}x  {e['kernel']}", flush=True)
    return events[:30]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", metavar="PART", help="engine, kernels (default: both)")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--md-out", type=Path, default=None, help="the kernels' table")
    parser.add_argument("--batch-sizes", default="1,32", help="the engine part's")
    parser.add_argument("--kernel-iters", type=int, default=200)
    parser.add_argument(
        "--adapter-ranks", default="16,16,16,16", help="the engine part's four adapters' ranks"
    )
    parser.add_argument(
        "--runs",
        default="",
        help="the engine part's runs, comma-separated keys of base, base-only, mixed, "
        "eager (default: all)",
    )
    parser.add_argument("--prefill-tokens", type=int, default=256, help="the engine part's")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="the engine part: each run's kernels (torch.profiler)",
    )
    args = parser.parse_args()
    args.parts = args.parts or ["engine", "kernels"]
    ranks = [int(r) for r in args.adapter_ranks.split(",")]
    keys = [k for k in args.runs.split(",") if k] or None
    if keys and set(keys) - set(RUN_KEYS):
        parser.error(f"--runs takes keys of {', '.join(RUN_KEYS)}, got {args.runs}")
    if len(ranks) != len(ADAPTERS):
        parser.error(f"--adapter-ranks takes {len(ADAPTERS)} ranks, got {args.adapter_ranks}")
    if set(args.parts) - {"engine", "kernels"}:
        parser.error(f"parts are engine and kernels, got {args.parts}")
    results: dict = {"gpu": gpu_name(), "torch": torch.__version__, "driver": _driver_version()}

    def save() -> None:  # after every run: a call cut short keeps what it measured
        if args.json_out:
            args.json_out.write_text(json.dumps(results, indent=1))

    if "kernels" in args.parts:
        results["kernel_rows"] = kernel_rows(iters=args.kernel_iters)
        table = kernel_markdown(results["kernel_rows"])
        print(table)
        if args.md_out:
            args.md_out.write_text(table)
        save()
    if "engine" in args.parts:
        results["rows"] = []
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        engine_rows(sizes, results["rows"], ranks, save, keys, args.profile, args.prefill_tokens)
        print(json.dumps(results["rows"], indent=1))
        save()


if __name__ == "__main__":
    main()
