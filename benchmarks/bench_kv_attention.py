"""Decode attention over a bf16 KV cache against an FP8 (e4m3) one, per stage-1 launch
config, on one CUDA GPU: where FP8 KV's halved bytes go (issue 27).

Llama-3.1-8B heads (32 q, 8 KV, head_dim 128), bf16 queries, pages of 16 in random order,
timed inside a CUDA graph over at least 256 MiB of KV (one call per "layer", so L2 cannot
hold them), as :mod:`bench_kernels` times the bf16 kernel. Each launch config replaces
``decode_attention._launch_config`` for its measurement; the default is the first.

    python3 -P benchmarks/bench_kv_attention.py --json-out kv-attention.json
    python3 -P benchmarks/bench_kv_attention.py --kv fp8_e4m3 --configs 128:3:4 \
        --splits 0,2,4,8,16 --json-out kv-splits.json

``--configs``: ``default`` and ``BLOCK_N:stages:warps`` items (default: ``CONFIGS``);
``--splits``: KV splits per request (0: the kernel's own choice, the default).
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_kernels import (
    DEVICE,
    HEAD_DIM,
    KV_HEADS,
    Q_HEADS,
    graph_time_ms,
    kv_pools,
    paged_indices,
)

from kvflow.kernels import decode_attention as decode_module
from kvflow.kernels import decode_attention_fwd

CONFIGS = [  # (BLOCK_N, num_stages, num_warps); None: the kernel's own choice
    None,
    (64, 2, 4),
    (64, 4, 4),
    (128, 2, 4),
    (128, 3, 4),
    (128, 2, 8),
    (256, 2, 8),
    (32, 3, 4),
]
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def time_case(
    batch: int, ctx: int, kv_dtype: torch.dtype, gen: torch.Generator, splits: int = 0
) -> float:
    """Microseconds per layer call of the decode kernel (``splits`` 0: its default)."""
    tokens = batch * ctx
    pools, num_slots = kv_pools(tokens, kv_dtype)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty_like(q)
    kv_indptr = torch.arange(0, tokens + 1, ctx, dtype=torch.int32, device=DEVICE)
    kv_indices = paged_indices(batch, ctx, num_slots, gen)
    calls = [
        lambda pool=pool: decode_attention_fwd(
            q, pool[0], pool[1], out, kv_indptr, kv_indices, HEAD_DIM**-0.5, splits or None
        )
        for pool in pools
    ]
    return graph_time_ms(calls) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="64x2048,256x2560", help="batch x context, ...")
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="peak HBM TB/s (H200)")
    parser.add_argument("--kv", default=",".join(KV_DTYPES), help="KV dtypes, ...")
    parser.add_argument("--configs", help="default,BLOCK_N:stages:warps,... (CONFIGS)")
    parser.add_argument("--splits", default="0", help="KV splits per request, ... (0: default)")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    configs = CONFIGS if not args.configs else [
        None if item == "default" else tuple(int(v) for v in item.split(":"))
        for item in args.configs.split(",")
    ]  # fmt: skip
    default = decode_module._launch_config
    rows = []
    cases = [
        (int(batch), int(ctx), name, splits)
        for batch, ctx in (case.split("x") for case in args.cases.split(","))
        for name in args.kv.split(",")
        for splits in (int(s) for s in args.splits.split(","))
    ]
    for batch, ctx, name, splits in cases:
        kv_dtype = KV_DTYPES[name]
        for config in configs:
            if config is not None:
                block_n, stages, warps = config
                fixed = {"BLOCK_N": block_n, "MIN_SPLIT": max(64, block_n),
                         "num_warps": warps, "num_stages": stages}  # fmt: skip
                decode_module._launch_config = lambda *_, fixed=fixed, **__: fixed
            try:
                gen = torch.Generator().manual_seed(0)
                us = time_case(batch, ctx, kv_dtype, gen, splits)
                error = None
            except Exception as failure:  # a config can run out of shared memory
                us, error = None, f"{type(failure).__name__}: {failure}"[:200]
            finally:
                decode_module._launch_config = default
                torch.cuda.empty_cache()
            kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * kv_dtype.itemsize
            tbps = kv_bytes / (us * 1e-6) / 1e12 if us else None
            row = {"batch": batch, "ctx": ctx, "kv": name, "config": config,
                   "splits": splits or "default", "us": us, "tbps": tbps, "error": error}  # fmt: skip
            rows.append(row)
            cell = f"{us:.1f} us, {tbps:.2f} TB/s ({tbps / args.hbm_tbps:.0%})" if us else error
            print(f"batch {batch} ctx {ctx} {name} {config or 'default'} splits "
                  f"{splits or 'default'}: {cell}", flush=True)  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
