"""The batch-1 FP8 GEMV's launch configurations on Llama-3.1-8B's projections (GPU).

For each projection shape (per-row scales, and 128x128 block scales) and each candidate
``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` of :func:`kvflow.kernels.fp8_gemv`: the time in
a CUDA graph and the fraction of HBM bandwidth its weight bytes reach, beside the bf16
:func:`kvflow.kernels.gemv` at its default on the same shape (the bytes FP8 halves).

    PYTHONPATH=benchmarks python3 -P benchmarks/bench_fp8_gemv.py --json-out fp8-gemv.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
from bench_experts import time_in_graph
from bench_gpu import gpu_name, peak_bw

SHAPES = {  # projection: (N, K), Llama-3.1-8B
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
}
CONFIGS = (  # (BLOCK_N, BLOCK_K, num_warps, num_stages); the default first
    (2, 1024, 4, 3),
    (2, 2048, 4, 3),
    (1, 2048, 4, 3),
    (4, 1024, 4, 3),
    (4, 2048, 8, 3),
    (1, 4096, 8, 2),
    (2, 2048, 8, 4),
    (8, 512, 4, 3),
    (4, 1024, 8, 4),
    (2, 4096, 8, 2),
    (8, 1024, 8, 3),
)


def bench_shape(n: int, k: int, blocked: bool) -> dict:
    from kvflow.kernels import FP8_DTYPE, fp8_gemv, fp8_gemv_ref, gemv

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w8 = w16.to(FP8_DTYPE)
    if blocked:
        scales = {
            "block_scale": torch.rand(n // 128, k // 128, device="cuda", generator=gen) * 1e-3,
            "block_size": (128, 128),
        }
    else:
        scales = {"row_scale": torch.rand(n, device="cuda", generator=gen) * 1e-3}
    row: dict = {"n": n, "k": k, "scales": "block 128x128" if blocked else "per row"}
    bf16_s = time_in_graph([partial(gemv, x, w16)] * 8)
    row["bf16_gemv_us"] = bf16_s * 1e6
    row["bf16_gemv_hbm_fraction"] = n * k * 2 / bf16_s / peak_bw()
    want = fp8_gemv_ref(x, w8, **scales).float()
    configs: dict = {}
    for config in CONFIGS:
        try:  # NOTE: one configuration that fails to compile must not cost the run
            seconds = time_in_graph([partial(fp8_gemv, x, w8, **scales, config=config)] * 8)
            got = fp8_gemv(x, w8, **scales, config=config).float()
            configs[str(config)] = {
                "us": seconds * 1e6,
                "hbm_fraction": n * k / seconds / peak_bw(),
                "max_abs_diff_vs_ref": float((got - want).abs().max()),
            }
        except Exception as error:
            configs[str(config)] = {"failed": f"{type(error).__name__}: {str(error)[:200]}"}
    row["fp8_configs"] = configs
    timed = {c: v["us"] for c, v in configs.items() if "us" in v}
    row["fp8_best"] = min(timed, key=timed.__getitem__) if timed else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        for blocked in (False, True):
            row = {"projection": name, **bench_shape(n, k, blocked)}
            rows.append(row)
            best = row["fp8_best"]
            print(
                name, row["scales"], f"bf16 {row['bf16_gemv_us']:.1f} us;",
                "fp8 default", f"{row['fp8_configs'][str(CONFIGS[0])].get('us', 0):.1f} us;",
                "best", best, f"{row['fp8_configs'][best]['us']:.1f} us" if best else "",
                flush=True,
            )  # fmt: skip
    result = {"gpu": gpu_name(), "torch": torch.__version__, "rows": rows}
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
