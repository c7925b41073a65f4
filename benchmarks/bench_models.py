"""Decode speed of each model family's real shapes on the GPU (random bf16 weights).

    python benchmarks/bench_models.py --json-out models.json

For every shipped dummy config named (default: Qwen3-8B, Mistral-7B-v0.3, Gemma-2-9B,
Qwen3-30B-A3B, with Llama-3.1-8B as the reference the other results are read against): the decode step at
batch 1 and 32 with 1,024-token contexts (CUDA graphs, ``bench_gpu.bench_decode``) and its
fraction of HBM bandwidth (weights read, for a mixture of experts only the experts the
batch routes to, plus the KV read). For a mixture of experts also one layer's experts
alone: the fused Triton kernel (``kernels.fused_moe``) against the per-expert loop
(``fused_experts_ref``, the CPU path) at batch 1 and 32, and the batch-1 kernel against the
roofline of the active experts' weights.

With ``--quantization fp8`` the decode runs the float weights quantized per channel at load
(dense layers and experts), and the experts' rows add the fused kernel on FP8 weights
(W8A16) with per-row and with 128x128 block scales (Qwen3-30B-A3B-FP8's format), their
HBM fraction counted on the FP8 bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from functools import partial
from pathlib import Path

import torch
from bench_gpu import _driver_version, bench_decode, gpu_name, peak_bw, time_cuda

MODELS = ("llama-3.1-8b", "qwen3-8b", "mistral-7b-v0.3", "gemma-2-9b", "qwen3-30b-a3b")


def _fp8_experts(w: torch.Tensor, block: tuple[int, int] | None):
    """``w`` ``[E, N, K]`` bf16 -> FP8 and the fused kernel's scales (per row, or per
    ``block``; N and K whole blocks)."""
    from kvflow.kernels import FP8_DTYPE, ExpertScales

    experts, n, k = w.shape
    if block is None:
        scale = w.float().abs().amax(-1).clamp(min=1e-12) / 448
        full = scale[..., None]
    else:
        tiles = w.float().view(experts, n // block[0], block[0], k // block[1], block[1])
        scale = tiles.abs().amax((2, 4)).clamp(min=1e-12) / 448
        full = scale.repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)
    q = (w.float() / full).clamp(-448, 448).to(FP8_DTYPE)
    return q, ExpertScales(scale.contiguous(), block)


def bench_experts(
    model: str, batch_sizes=(1, 32), iters: int = 200, fp8: bool = False
) -> list[dict]:
    """One MoE layer's experts in the model's shapes: fused kernel vs per-expert loop (and
    with ``fp8`` the fused kernel on FP8 weights, per-row and 128x128 block scales)."""
    from kvflow import kernels
    from kvflow.runtime.config import DUMMY_CONFIGS, ModelConfig
    from kvflow.runtime.layers import fused_experts_ref, select_experts

    mc = ModelConfig.from_path(DUMMY_CONFIGS[model])
    experts, top_k = mc.num_experts, mc.num_experts_per_tok
    hidden, inter = mc.hidden_size, mc.moe_intermediate_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dt, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=dt, generator=gen) * 0.02
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    rows = []
    for bs in batch_sizes:
        x = torch.randn(bs, hidden, device=dev, dtype=dt, generator=gen)
        logits = torch.randn(bs, experts, device=dev, generator=gen)
        topk = select_experts(logits, top_k, renormalize=bool(mc.norm_topk_prob))
        fused_s = time_cuda(
            partial(kernels.fused_moe, x, w13, w2, topk.weights, topk.ids), iters, warmup=3
        )
        loop_s = time_cuda(
            partial(fused_experts_ref, x, w13, w2, topk), max(iters // 10, 10), warmup=3
        )
        got = kernels.fused_moe(x, w13, w2, topk.weights, topk.ids).float()
        want = fused_experts_ref(x, w13, w2, topk).float()
        distinct = int(topk.ids.unique().numel())
        row = {
            "batch": bs,
            "fused_us": fused_s * 1e6,
            "per_expert_loop_us": loop_s * 1e6,
            "speedup": loop_s / fused_s,
            "experts_routed": distinct,
            "hbm_fraction_of_routed_experts": distinct * per_expert / fused_s / peak_bw(),
            "max_abs_diff_vs_loop": float((got - want).abs().max()),
        }
        for name, block in (("fp8_row", None), ("fp8_block", (128, 128))) if fp8 else ():
            q13, s13 = _fp8_experts(w13, block)
            q2, s2 = _fp8_experts(w2, block)
            run = partial(kernels.fused_moe, x, q13, q2, topk.weights, topk.ids, s13, s2)
            fp8_s = time_cuda(run, iters, warmup=3)
            fp8_bytes = distinct * (q13[0].numel() + q2[0].numel())  # 1 byte each
            row[f"{name}_us"] = fp8_s * 1e6
            row[f"{name}_speedup_vs_bf16"] = fused_s / fp8_s
            row[f"{name}_hbm_fraction"] = fp8_bytes / fp8_s / peak_bw()
            row[f"{name}_max_abs_diff_vs_bf16"] = float((run().float() - got).abs().max())
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument(
        "--quantization",
        choices=["fp8"],
        default=None,
        help="fp8: quantize the dummy weights per channel at load (SGLang's flag), and time "
        "the FP8 experts' kernel beside the bf16 one",
    )
    args = parser.parse_args()
    import triton

    results: dict = {
        "gpu": gpu_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "driver": _driver_version(),
        "quantization": args.quantization,
        "models": {},
    }
    from kvflow.runtime.config import DUMMY_CONFIGS, ModelConfig

    for model in args.models:
        started = time.perf_counter()
        decode = bench_decode(batch_sizes=(1, 32), model=model, quantization=args.quantization)
        entry: dict = {"decode": decode}
        gc.collect()
        torch.cuda.empty_cache()
        if ModelConfig.from_path(DUMMY_CONFIGS[model]).num_experts:
            entry["experts"] = bench_experts(model, fp8=args.quantization == "fp8")
        results["models"][model] = entry
        print(model, json.dumps(entry, indent=1), f"({time.perf_counter() - started:.0f} s)")
        gc.collect()
        torch.cuda.empty_cache()
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
