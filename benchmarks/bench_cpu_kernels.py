"""CPU micro-benchmarks: kvflow's native CPU kernels (attention, matmul, row-wise ops) against the
torch code they replace, plus the offline engine with the native kernels on and off.

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, hidden 576, intermediate
1536, vocabulary 49152). Each pair is timed interleaved (A, B, A, B, ...) and the median of
each side is reported, so a noisy shared machine moves both sides alike; compare the ratios.
Decode attention runs one call per layer over 30 layers' pools (more than a cache holds),
as a decode step does. The engine rows time `Engine.generate` on 32 prompts of 170 tokens
with 64 output tokens (EOS ignored), in a subprocess each, alternating on and off; the
decode-step rows time one request's decode steps with the CPU decode graph
(:mod:`kvflow.runtime.cpu_graph`) off and on, the same way.

    python benchmarks/bench_cpu_kernels.py --out benchmarks/results/cpu-kernels.md
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kvflow.kernels import build_cos_sin_cache, rmsnorm_ref, rotary_embedding_ref, silu_and_mul_ref
from kvflow.kernels import cpu as native
from kvflow.runtime.attention.cpu_backend import CpuKernelBackend
from kvflow.runtime.attention.torch_backend import TorchBackend
from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode
from kvflow.runtime.layers import pack_weight
from kvflow.runtime.mem import KVPool, ReqToTokenPool

HEADS, KV_HEADS, DIM, HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 9, 3, 64, 576, 1536, 49152, 30
PROJECTIONS = {
    "qkv_proj": (HEADS * DIM + 2 * KV_HEADS * DIM, HIDDEN),
    "o_proj": (HIDDEN, HEADS * DIM),
    "gate_up_proj": (2 * INTERMEDIATE, HIDDEN),
    "down_proj": (HIDDEN, INTERMEDIATE),
    "lm_head": (VOCAB, HIDDEN),
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

ENGINE_RUN = """
import json, random, sys, time
from kvflow.runtime.engine import Engine
from kvflow.runtime.models import embedded_model_path
engine = Engine(str(embedded_model_path()), dtype=sys.argv[1])
random.seed(0)
prompts = [[random.randint(100, 40000) for _ in range(170)] for _ in range(32)]
params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
engine.generate(input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4})
engine.flush_cache()
start = time.perf_counter()
engine.generate(input_ids=prompts, sampling_params=params)
print(json.dumps({"tok_s": 32 * 64 / (time.perf_counter() - start)}))
"""


DECODE_STEP_RUN = """
import json, random, sys, time
from kvflow.runtime.engine import Engine
from kvflow.runtime.models import embedded_model_path
engine = Engine(str(embedded_model_path()), dtype=sys.argv[1])
random.seed(0)
prompt = [random.randint(100, 40000) for _ in range(100)]
def run(new):
    engine.flush_cache()
    start = time.perf_counter()
    params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    engine.generate(input_ids=prompt, sampling_params=params)
    return time.perf_counter() - start
run(8)
steps = sorted((run(129) - run(1)) / 128 for _ in range(3))
print(json.dumps({"step_ms": steps[1] * 1e3}))
"""


def paired(a: Callable[[], object], b: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median seconds of ``a`` and of ``b``, timed alternately after one warm-up each."""
    a(), b()
    times_a, times_b = [], []
    for _ in range(reps):
        for fn, times in ((a, times_a), (b, times_b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


def row(name: str, base: float, ours: float) -> str:
    return f"| {name} | {base * 1e3:.3f} | {ours * 1e3:.3f} | {base / ours:.2f}x |"


def bench_projections(dtype: torch.dtype, reps: int) -> list[str]:
    """Per shape and row count: F.linear vs what the engine runs (the packed weight's path),
    and oneDNN-prepacked vs the native matmul where both apply."""
    lines = []
    for rows in (1, 32, 2048):
        for name, (n, k) in PROJECTIONS.items():
            if name == "lm_head" and rows == 2048:
                continue  # the head only sees each request's last token
            weight = torch.randn(n, k).to(dtype)
            packed = pack_weight(weight)
            x = torch.randn(rows, k).to(dtype)
            count = reps if rows < 2048 else max(3, reps // 10)
            base, ours = paired(
                lambda x=x, w=weight: F.linear(x, w), lambda x=x, p=packed: p.matmul(x), count
            )
            lines.append(row(f"{name} {rows} x {k} -> {n}: F.linear / engine", base, ours))
            if native.available() and native.gemm.supports(weight):
                onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
                panels = native.gemm.pack(weight)
                base, ours = paired(
                    lambda x=x, w=onednn: torch.ops.mkldnn._linear_pointwise(
                        x, w, None, "none", [], ""
                    ),
                    lambda x=x, w=panels, n=n: native.gemm.gemm(x, w, n),
                    count,
                )
                lines.append(row(f"{name} {rows} x {k} -> {n}: oneDNN / native", base, ours))
    return lines


def _gguf_weight(n: int, k: int, block_type: str, dtype: torch.dtype) -> native.qgemm.QuantPacked:
    """A random ``[n, k]`` weight quantized by ``gguf`` and packed for ``dtype`` activations."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    weight = (torch.randn(n, k) * 0.05).numpy()
    raw = torch.from_numpy(quantize(weight, GGMLQuantizationType[block_type]))
    return native.qgemm.pack(raw, block_type, dtype)


def bench_gguf(dtype: torch.dtype, reps: int) -> list[str]:
    """The GGUF block matmul (``--quantization gguf``) vs the native matmul of the model's
    dtype, per projection (weights cache-resident after the first call), then a decode
    step's projections over 30 layers and the head (weights streamed from memory, as a
    decode step reads them)."""
    lines = []
    for rows in (1, 32, 2048):
        for name, (n, k) in PROJECTIONS.items():
            if name == "lm_head" and rows == 2048:
                continue
            dense = native.gemm.pack(torch.randn(n, k).to(dtype))
            x = torch.randn(rows, k).to(dtype)
            count = reps if rows < 2048 else max(3, reps // 10)
            for block_type in ("Q8_0", "Q4_1"):
                packed = _gguf_weight(n, k, block_type, dtype)
                base, ours = paired(
                    lambda x=x, w=dense, n=n: native.gemm.gemm(x, w, n),
                    lambda x=x, p=packed: native.qgemm.qgemm(x, p),
                    count,
                )
                lines.append(row(f"{name} {rows} x {k} -> {n}: {block_type}", base, ours))
    step = [(name, n, k) for name, (n, k) in PROJECTIONS.items() if name != "lm_head"]
    dense_layers = [
        [(native.gemm.pack(torch.randn(n, k).to(dtype)), n, k) for _, n, k in step]
        for _ in range(LAYERS)
    ]
    quant_layers = [[_gguf_weight(n, k, "Q4_1", dtype) for _, n, k in step] for _ in range(LAYERS)]
    vocab, hidden = PROJECTIONS["lm_head"]
    dense_head = native.gemm.pack(torch.randn(vocab, hidden).to(dtype))
    quant_head = _gguf_weight(vocab, hidden, "Q8_0", dtype)
    x = {k: torch.randn(1, k).to(dtype) for _, _, k in step}

    def dense_step() -> None:
        for layer in dense_layers:
            for panels, n, k in layer:
                native.gemm.gemm(x[k], panels, n)
        native.gemm.gemm(x[hidden], dense_head, vocab)

    def quant_step() -> None:
        for layer in quant_layers:
            for packed in layer:
                native.qgemm.qgemm(x[packed.k], packed)
        native.qgemm.qgemm(x[hidden], quant_head)

    base, ours = paired(dense_step, quant_step, max(5, reps // 3))
    lines.append(row("decode step, 1 row: 30 layers' projections (Q4_1) + head (Q8_0)", base, ours))
    return lines


def _decode_batch(rows: ReqToTokenPool, contexts: list[int]) -> ForwardBatch:
    """One decode step over fresh requests whose contexts fill the pool in order."""
    slot, reqs, locs = 1, [], []
    for length in contexts:
        req = rows.alloc()
        rows.write(req, 0, torch.arange(slot, slot + length))
        reqs.append(req)
        locs.append(slot + length - 1)
        slot += length
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(len(contexts), dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in contexts]),
        out_cache_loc=torch.tensor(locs),
        req_pool_indices=torch.tensor(reqs),
        seq_lens=torch.tensor(contexts),
        seq_lens_cpu=list(contexts),
    )


def _random_pool(slots: int, dtype: torch.dtype) -> KVPool:
    pool = KVPool(slots, LAYERS, KV_HEADS, DIM, dtype, "cpu")
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.normal_()
    return pool


def _backend_steps(
    pool: KVPool,
    req_rows: ReqToTokenPool,
    fb: ForwardBatch,
    layer: Callable[[TorchBackend, ForwardBatch, int], object],
) -> list[Callable[[], object]]:
    """One step over every layer for the torch backend, then for the native one."""
    steps = []
    for cls in (TorchBackend, CpuKernelBackend):
        backend = cls(pool, req_rows, HEADS, KV_HEADS, DIM, 1 / math.sqrt(DIM))
        own = copy.copy(fb)
        backend.init_forward_metadata(own)
        steps.append(lambda b=backend, f=own: [layer(b, f, i) for i in range(LAYERS)])
    return steps


def _decode_attention(dtype: torch.dtype, batch: int, context: int, reps: int) -> str:
    pool = _random_pool(batch * context + 2, dtype)
    req_rows = ReqToTokenPool(batch + 1, context + 1, "cpu")
    fb = _decode_batch(req_rows, [context] * batch)
    q = torch.randn(batch, HEADS, DIM).to(dtype)
    steps = _backend_steps(
        pool, req_rows, fb, lambda b, f, i: b.forward_decode(q, None, None, i, f)
    )
    base, ours = paired(steps[0], steps[1], reps)
    return row(f"{LAYERS} layers, batch {batch}, context {context}", base, ours)


def bench_decode_attention(dtype: torch.dtype, reps: int) -> list[str]:
    return [_decode_attention(dtype, b, c, reps) for b, c in ((1, 1024), (32, 230), (64, 1024))]


def bench_extend_attention(dtype: torch.dtype, reps: int) -> list[str]:
    """A 2040-token prefill chunk (12 prompts of 170 tokens, nothing cached) over 30 layers."""
    count, new = 12, 170
    pool = _random_pool(count * new + 2, dtype)
    req_rows = ReqToTokenPool(count + 1, new + 1, "cpu")
    reqs = []
    for i in range(count):
        req = req_rows.alloc()
        req_rows.write(req, 0, torch.arange(1 + i * new, 1 + (i + 1) * new))
        reqs.append(req)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.zeros(count * new, dtype=torch.int64),
        positions=torch.arange(new).repeat(count),
        out_cache_loc=torch.arange(1, 1 + count * new),
        req_pool_indices=torch.tensor(reqs),
        seq_lens=torch.full((count,), new),
        seq_lens_cpu=[new] * count,
        extend_prefix_lens_cpu=[0] * count,
        extend_seq_lens_cpu=[new] * count,
    )
    q = torch.randn(count * new, HEADS, DIM).to(dtype)
    kv = torch.randn(count * new, KV_HEADS, DIM).to(dtype)
    steps = _backend_steps(pool, req_rows, fb, lambda b, f, i: b.forward_extend(q, kv, kv, i, f))
    base, ours = paired(steps[0], steps[1], max(3, reps // 10))
    return [row(f"{LAYERS} layers, {count} prompts x {new} new tokens", base, ours)]


def _elementwise(dtype: torch.dtype, rows: int, reps: int) -> list[str]:
    table = build_cos_sin_cache(DIM, 8192, 100000.0, None)
    x = torch.randn(rows, HIDDEN).to(dtype)
    residual = torch.randn(rows, HIDDEN).to(dtype)
    weight = torch.randn(HIDDEN).to(dtype)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM).to(dtype)
    q = qkv[:, : HEADS * DIM].view(rows, HEADS, DIM)
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(rows, KV_HEADS, DIM)
    positions = torch.randint(0, 8192, (rows,))
    gate_up = torch.randn(rows, 2 * INTERMEDIATE).to(dtype)
    ew = native.elementwise
    pairs = {
        f"RMSNorm + residual, {rows} x {HIDDEN}": (
            lambda: rmsnorm_ref(x, weight, 1e-5, residual),
            lambda: ew.rmsnorm(x, weight, 1e-5, residual),
        ),
        f"rotary (q and k), {rows} tokens": (
            lambda: rotary_embedding_ref(positions, q, k, table, DIM),
            lambda: ew.rotary_embedding(positions, q, k, table, DIM),
        ),
        f"SiLU-and-mul, {rows} x {2 * INTERMEDIATE}": (
            lambda: silu_and_mul_ref(gate_up),
            lambda: ew.silu_and_mul(gate_up),
        ),
    }
    return [row(name, *paired(base, ours, reps)) for name, (base, ours) in pairs.items()]


def bench_elementwise(dtype: torch.dtype, reps: int) -> list[str]:
    return _elementwise(dtype, 32, reps) + _elementwise(dtype, 2048, reps)


def _alternate(script: str, dtype: str, switch: str, rounds: int) -> dict[str, list[float]]:
    """The number ``script`` prints last (``{"key": value}``), run in a subprocess per
    round with the environment variable ``switch`` at 0 (off) and 1 (on), alternating."""
    results: dict[str, list[float]] = {"0": [], "1": []}
    for _ in range(rounds):
        for flag in ("0", "1"):
            done = subprocess.run(
                [sys.executable, "-P", "-c", script, dtype],
                capture_output=True,
                text=True,
                env={**os.environ, switch: flag},
                check=True,
            )
            results[flag].append(
                float(done.stdout.strip().splitlines()[-1].split(":")[1].strip(" }"))
            )
    return results


def _runs(results: dict[str, list[float]], unit: str) -> str:
    runs = "; ".join(
        f"{label}: {', '.join(f'{v:.1f}' for v in results[flag])}"
        for label, flag in (("off", "0"), ("on", "1"))
    )
    return f"({unit}, {runs})"


def bench_engine(dtype: str, rounds: int) -> list[str]:
    results = _alternate(ENGINE_RUN, dtype, "KVFLOW_CPU_KERNELS", rounds)
    off, on = statistics.median(results["0"]), statistics.median(results["1"])
    return [
        f"| `Engine.generate`, {dtype}, 32 x 170 prompt tokens, 64 output tokens | "
        f"{off:.1f} tok/s | {on:.1f} tok/s | {on / off:.2f}x |",
        "",
        f"Medians of {rounds} alternating runs each {_runs(results, 'tok/s')}.",
    ]


def bench_decode_step(dtype: str, rounds: int) -> list[str]:
    results = _alternate(DECODE_STEP_RUN, dtype, "KVFLOW_CPU_DECODE_GRAPH", rounds)
    off, on = statistics.median(results["0"]), statistics.median(results["1"])
    return [
        f"| `Engine.generate` decode step, {dtype}, 1 request, 100 prompt tokens | "
        f"{off:.2f} ms | {on:.2f} ms | {off / on:.2f}x |",
        "",
        f"Medians of {rounds} alternating runs each {_runs(results, 'ms per step')}; each run "
        "the median of 3 (129-token generate - 1-token generate) / 128.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--engine-rounds", type=int, default=2)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument(
        "--sections",
        default="projections,attention,elementwise,gguf,engine,decode-step",
        help="comma-separated: which tables to measure",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu-kernels.md"))
    args = parser.parse_args()
    if not native.available():
        sys.exit("the native CPU kernels did not build here (see the log): nothing to compare")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    load_before = os.getloadavg()
    lines = [
        "# CPU kernels: native C kernels and prepacked projections vs the torch code they replace",
        "",
        "Generated by `benchmarks/bench_cpu_kernels.py`; numbers are measured, never edited.",
        "",
        "```",
        "python " + " ".join(["benchmarks/bench_cpu_kernels.py", *sys.argv[1:]]),
        "```",
        "",
        f"Run on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, kvflow commit {commit}; load average before "
        f"{', '.join(f'{v:.2f}' for v in load_before)}. Medians of {args.reps} interleaved "
        "repetitions (shared machine: read the ratios).",
    ]
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        header = [
            "",
            "| what | torch (ms) | kvflow (ms) | speed-up |",
            "| --- | ---: | ---: | ---: |",
        ]
        sections = set(args.sections.split(","))
        lines += ["", f"## {name}"]
        if "projections" in sections:
            lines += [
                "",
                "### Projections: `F.linear` vs the engine's packed path; oneDNN-prepacked vs "
                "native matmul",
                *header[1:],
            ]
            lines += bench_projections(dtype, args.reps)
        if "attention" in sections:
            lines += [
                "",
                "### Decode attention: torch backend (gather + bmm) vs native kernel",
                *header[1:],
            ]
            lines += bench_decode_attention(dtype, args.reps)
            lines += ["", "### Extend attention: torch backend vs native kernel", *header[1:]]
            lines += bench_extend_attention(dtype, args.reps)
        if "elementwise" in sections:
            lines += ["", "### Row-wise ops: torch references vs native kernels", *header[1:]]
            lines += bench_elementwise(dtype, args.reps)
        if "gguf" in sections:
            lines += [
                "",
                f"### GGUF blocks (`--quantization gguf`): native {name} matmul vs the block "
                "matmul (`qgemm`)",
                "",
                f"| what | {name} (ms) | GGUF (ms) | speed-up |",
                "| --- | ---: | ---: | ---: |",
            ]
            lines += bench_gguf(dtype, args.reps)
        if "engine" in sections:
            lines += [
                "",
                "### Offline engine: `KVFLOW_CPU_KERNELS=0` vs default",
                "",
                "| what | off | on | speed-up |",
                "| --- | ---: | ---: | ---: |",
            ]
            lines += bench_engine(name, args.engine_rounds)
        if "decode-step" in sections:
            lines += [
                "",
                "### Single-stream decode step: `KVFLOW_CPU_DECODE_GRAPH=0` vs default",
                "",
                "| what | per-layer path | decode graph | speed-up |",
                "| --- | ---: | ---: | ---: |",
            ]
            lines += bench_decode_step(name, args.engine_rounds)
    lines += ["", f"Load average after: {', '.join(f'{v:.2f}' for v in os.getloadavg())}.", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
