"""Micro-benchmarks of kvflow's Triton kernels on one CUDA GPU, written as markdown.

Llama-3.1-8B head shapes (32 q heads, 8 KV heads, head_dim 128, bf16, hidden 4096,
intermediate 14336). Decode attention is timed inside a CUDA graph, one call per "layer"
over distinct KV buffers (at least 256 MiB in all, so the 50 MB L2 cannot hold them), the
way a captured decode step runs; the rest with ``triton.testing.do_bench`` (median, L2
flushed between runs). Baselines: torch SDPA on contiguous KV (a lower bound: no paging)
and torch's gather-then-SDPA (what a pure-torch paged backend does), plus the pure-torch
references for the small kernels.

    python benchmarks/bench_kernels.py [--out results.md] [--hbm-tbps 3.35]
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from kvflow.kernels import (
    build_cos_sin_cache,
    decode_attention_fwd,
    default_num_kv_splits,
    extend_attention_fwd,
    rmsnorm,
    rmsnorm_ref,
    rotary_embedding,
    rotary_embedding_ref,
    silu_and_mul,
    silu_and_mul_ref,
    store_kv_cache,
    store_kv_cache_ref,
    top_k_top_p_sampling_from_probs,
)

Q_HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 8, 128, 4096, 14336
DTYPE = torch.bfloat16
PAGE_SIZE = 16
DEVICE = "cuda"  # a CPU dry run under TRITON_INTERPRET=1 swaps this and the timers


def graph_time_ms(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Median GPU time of one call, from a CUDA graph holding all ``calls`` in order."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return sorted(times)[len(times) // 2]


def bench_ms(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def paged_indices(batch: int, ctx: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    pages = torch.randperm(num_slots // PAGE_SIZE, generator=gen)[: batch * ctx // PAGE_SIZE]
    slots = pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)[None, :]
    return slots.flatten().to(torch.int32).to(DEVICE)


def kv_pools(tokens: int, dtype: torch.dtype) -> tuple[list[tuple[torch.Tensor, ...]], int]:
    """Random (K, V) pools of ``tokens`` slots and a few spare pages, one per "layer", as
    many as make at least 256 MiB (so the 50 MB L2 cannot hold them); and their slots."""
    kv_bytes = 2 * tokens * KV_HEADS * HEAD_DIM * dtype.itemsize
    layers = max(2, math.ceil(256 * 2**20 / kv_bytes))
    num_slots = tokens + PAGE_SIZE * 4
    pools = [
        tuple(torch.randn(num_slots, KV_HEADS, HEAD_DIM, device=DEVICE).to(dtype) for _ in range(2))
        for _ in range(layers)
    ]
    return pools, num_slots


def decode_row(batch: int, ctx: int, hbm_tbps: float, gen: torch.Generator) -> str:
    tokens = batch * ctx
    kv_bytes = 2 * tokens * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    pools, num_slots = kv_pools(tokens, DTYPE)
    layers = len(pools)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    out = torch.empty_like(q)
    kv_indptr = torch.arange(0, tokens + 1, ctx, dtype=torch.int32, device=DEVICE)
    kv_indices = paged_indices(batch, ctx, num_slots, gen)
    splits = default_num_kv_splits(batch, KV_HEADS, q.device)

    def triton_call(pool, n_splits=splits):
        return lambda: decode_attention_fwd(
            q, pool[0], pool[1], out, kv_indptr, kv_indices, HEAD_DIM**-0.5, n_splits
        )

    triton_ms = graph_time_ms([triton_call(pool) for pool in pools])
    eager_ms = bench_ms(triton_call(pools[0]))
    sweep = {n: graph_time_ms([triton_call(pool, n) for pool in pools]) for n in (1, 2, 4, 8, 16)}

    # Dense baseline: the same KV gathered once into [batch, kv_heads, ctx, dim].
    q4 = q[:, :, None, :]

    def dense(buf):
        return buf[kv_indices.long()].view(batch, ctx, KV_HEADS, HEAD_DIM).transpose(1, 2)

    dense_kv = [(dense(k).contiguous(), dense(v).contiguous()) for k, v in pools[: layers // 2 + 1]]
    sdpa_ms = graph_time_ms(
        [
            lambda k=k, v=v: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            for k, v in dense_kv
        ]
    )
    del dense_kv
    gather_ms = graph_time_ms(
        [
            lambda k=k, v=v: F.scaled_dot_product_attention(q4, dense(k), dense(v), enable_gqa=True)
            for k, v in pools[:2]
        ]
    )
    tbps = kv_bytes / (triton_ms * 1e-3) / 1e12
    sweep_cell = ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in sweep.items())
    return (
        f"| {batch} | {ctx} | {splits} | {triton_ms * 1e3:.1f} | {eager_ms * 1e3:.1f} | "
        f"{tbps:.2f} ({tbps / hbm_tbps:.0%}) | {sdpa_ms * 1e3:.1f} | {gather_ms * 1e3:.1f} | "
        f"{sweep_cell} |"
    )


def decode_rows(ctx: int, hbm_tbps: float) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in (1, 32, 128):
        rows.append(decode_row(batch, ctx, hbm_tbps, gen))
        torch.cuda.empty_cache()
    return rows


def extend_row(prefix: int, extend: int) -> str:
    def randn(*shape):
        return torch.randn(*shape, dtype=DTYPE, device=DEVICE)

    q, k, v = randn(extend, Q_HEADS, HEAD_DIM), *(randn(extend, KV_HEADS, HEAD_DIM) for _ in "kv")
    out = torch.empty_like(q)
    num_slots = prefix + 4 * PAGE_SIZE
    k_buf, v_buf = randn(num_slots, KV_HEADS, HEAD_DIM), randn(num_slots, KV_HEADS, HEAD_DIM)
    kv_indices = paged_indices(1, prefix, num_slots, torch.Generator().manual_seed(1))
    qo_indptr = torch.tensor([0, extend], dtype=torch.int32, device=DEVICE)
    kv_indptr = torch.tensor([0, prefix], dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM**-0.5
    triton_ms = bench_ms(
        lambda: extend_attention_fwd(
            q, k, v, out, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, extend, scale
        )
    )
    # Causal FLOPs: QK^T and PV over the prefix (full) and the new tokens (half).
    flops = 4 * Q_HEADS * HEAD_DIM * extend * (prefix + (extend + 1) / 2)
    sdpa_cell = "n/a (prefix)"
    if prefix == 0:
        q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
        sdpa_ms = bench_ms(
            lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
        )
        sdpa_cell = f"{sdpa_ms * 1e3:.0f} ({flops / sdpa_ms / 1e9:.0f} TFLOP/s)"
    return (
        f"| {prefix} | {extend} | {triton_ms * 1e3:.0f} | {flops / triton_ms / 1e9:.0f} | "
        f"{sdpa_cell} |"
    )


def extend_rows(prompt: int) -> list[str]:
    return [extend_row(prefix, prompt - prefix) for prefix in (0, prompt // 2)]


def tuning_rows(ctx: int, prompt: int, hbm_tbps: float) -> list[str]:
    """Other tile / pipelining configs than the defaults, for future tuning: the private
    launch-config functions are swapped for the duration of one measurement."""
    from kvflow.kernels import decode_attention as decode_module
    from kvflow.kernels import extend_attention as extend_module

    rows = []
    default_decode = decode_module._launch_config
    for block_n, stages in ((64, 3), (32, 2), (64, 2), (128, 2), (64, 4)):
        config = {
            "BLOCK_N": block_n,
            "MIN_SPLIT": max(64, block_n),
            "num_warps": 4,
            "num_stages": stages,
        }
        decode_module._launch_config = (
            lambda interpreted, element_size=2, kv_element_size=2, config=config: config
        )
        try:
            cell = decode_row(128, ctx, hbm_tbps, torch.Generator().manual_seed(0))
            cell = " / ".join(part.strip() for part in cell.split("|")[4:7])
        except Exception as error:  # a config can run out of shared memory
            cell = f"failed: {type(error).__name__}"
        finally:
            decode_module._launch_config = default_decode
        rows.append(f"| decode b128 | BLOCK_N {block_n}, stages {stages} | {cell} |")
        torch.cuda.empty_cache()
    default_extend = extend_module._launch_config
    for block_m, block_n, warps, stages in (
        (128, 64, 8, 1), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2),
    ):  # fmt: skip
        config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        extend_module._launch_config = lambda head_dim, interpreted, element_size=2, config=config: (
            config
        )
        try:
            cell = " / ".join(part.strip() for part in extend_row(0, prompt).split("|")[3:5])
        except Exception as error:
            cell = f"failed: {type(error).__name__}"
        finally:
            extend_module._launch_config = default_extend
        rows.append(
            f"| extend {prompt} | BLOCK {block_m}x{block_n}, warps {warps}, stages {stages} "
            f"| {cell} |"
        )
    return rows


def torch_sort_sampling(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """The usual vectorised torch top-k/top-p sampler (sort, cumsum, multinomial)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[1], device=probs.device)
    sorted_probs = sorted_probs.masked_fill(ranks[None] >= top_k[:, None], 0.0)
    cumulative = sorted_probs.cumsum(-1)
    outside = cumulative - sorted_probs > top_p[:, None] * cumulative[:, -1:]
    choice = torch.multinomial(sorted_probs.masked_fill(outside, 0.0), 1)
    return order.gather(1, choice)


def small_kernel_rows(tokens: int, hbm_tbps: float) -> list[str]:
    gen = torch.Generator().manual_seed(2)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DTYPE).to(DEVICE)

    x, residual, weight = randn(tokens, HIDDEN), randn(tokens, HIDDEN), randn(HIDDEN)
    gate_up = randn(tokens, 2 * INTERMEDIATE)
    positions = torch.arange(tokens, device=DEVICE)
    cache = build_cos_sin_cache(HEAD_DIM, 8192, 500000.0).to(DEVICE)
    q, k = randn(tokens, Q_HEADS * HEAD_DIM), randn(tokens, KV_HEADS * HEAD_DIM)
    k_buf, v_buf = randn(2 * tokens, KV_HEADS, HEAD_DIM), randn(2 * tokens, KV_HEADS, HEAD_DIM)
    loc = torch.randperm(2 * tokens, device=DEVICE)[:tokens]
    new_k, new_v = randn(tokens, KV_HEADS, HEAD_DIM), randn(tokens, KV_HEADS, HEAD_DIM)
    vocab, rows_sampled = 128256, 64
    probs = torch.softmax(torch.randn(rows_sampled, vocab, device=DEVICE) * 3, dim=-1)
    top_k = torch.full((rows_sampled,), 50, dtype=torch.int32, device=DEVICE)
    top_p = torch.full((rows_sampled,), 0.9, device=DEVICE)
    uniform = torch.rand(rows_sampled, device=DEVICE)
    item = DTYPE.itemsize
    cases = [
        ("rmsnorm + residual", 4 * tokens * HIDDEN * item,
         lambda: rmsnorm(x, weight, 1e-5, residual), lambda: rmsnorm_ref(x, weight, 1e-5, residual)),
        ("silu_and_mul", 3 * tokens * INTERMEDIATE * item,
         lambda: silu_and_mul(gate_up), lambda: silu_and_mul_ref(gate_up)),
        ("rotary_embedding", 2 * tokens * (Q_HEADS + KV_HEADS) * HEAD_DIM * item,
         lambda: rotary_embedding(positions, q, k, cache, HEAD_DIM),
         lambda: rotary_embedding_ref(positions, q, k, cache, HEAD_DIM)),
        ("store_kv_cache", 4 * tokens * KV_HEADS * HEAD_DIM * item,
         lambda: store_kv_cache(k_buf, v_buf, loc, new_k, new_v),
         lambda: store_kv_cache_ref(k_buf, v_buf, loc, new_k, new_v)),
        (f"top-k 50 / top-p 0.9 sampling, vocab {vocab}", None,
         lambda: top_k_top_p_sampling_from_probs(probs, top_k, top_p, uniform),
         lambda: torch_sort_sampling(probs, top_k, top_p)),
    ]  # fmt: skip
    rows = []
    for name, nbytes, kernel, reference in cases:
        kernel_ms, ref_ms = bench_ms(kernel), bench_ms(reference)
        count = tokens if nbytes else rows_sampled
        tbps = nbytes / (kernel_ms * 1e-3) / 1e12 if nbytes else 0.0
        bandwidth = f"{tbps:.2f} ({tbps / hbm_tbps:.0%})" if nbytes else "n/a (63 passes)"
        rows.append(
            f"| {name} | {count} | {kernel_ms * 1e3:.1f} | {bandwidth} | "
            f"{ref_ms * 1e3:.1f} | {ref_ms / kernel_ms:.1f}x |"
        )
    return rows


def environment() -> list[str]:
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as error:
        smi = f"nvidia-smi unavailable ({error})"
    props = torch.cuda.get_device_properties(0)
    return [
        f"- GPU: {smi} ({props.multi_processor_count} SMs)",
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
        f"Python {sys.version.split()[0]}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown here as well as to stdout")
    parser.add_argument("--hbm-tbps", type=float, default=3.35, help="peak HBM TB/s (H100 SXM)")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=4096)
    args = parser.parse_args()
    torch.manual_seed(0)
    lines = [*environment(), ""]
    lines += [
        f"### Decode attention (ctx {args.ctx}, q/kv heads {Q_HEADS}/{KV_HEADS}, dim {HEAD_DIM}, "
        f"bf16, page {PAGE_SIZE}); times in µs per layer call",
        "",
        "| batch | ctx | splits | triton (graph) | triton (eager) | KV TB/s (of peak) "
        "| SDPA dense (graph) | gather+SDPA (graph) | splits sweep (graph) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *decode_rows(args.ctx, args.hbm_tbps),
        "",
        f"### Extend attention ({args.prompt}-token prompt, causal, bf16); times in µs",
        "",
        "| cached prefix | new tokens | triton | TFLOP/s | SDPA (flash, causal) |",
        "| --- | --- | --- | --- | --- |",
        *extend_rows(args.prompt),
        "",
        "### Small kernels (bf16, eager); times in µs",
        "",
        "| kernel | tokens (rows) | triton | TB/s (of peak) | torch reference | speed-up |",
        "| --- | --- | --- | --- | --- | --- |",
        *small_kernel_rows(args.prompt, args.hbm_tbps),
        "",
        "### Tuning sweep (non-default launch configs; defaults are the first row of each)",
        "",
        "| case | config | decode: graph µs / eager µs / TB/s; extend: µs / TFLOP/s |",
        "| --- | --- | --- |",
        *tuning_rows(args.ctx, args.prompt, args.hbm_tbps),
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
