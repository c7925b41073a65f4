"""Decode speed of each model family's real shapes on the GPU (random bf16 weights).

    python benchmarks/bench_models.py --json-out models.json

For every shipped dummy config named (default: Qwen3-8B, Mistral-7B-v0.3, Gemma-2-9B,
Qwen3-30B-A3B, with Llama-3.1-8B as the reference the other results are read against): the decode step at
batch 1 and 32 with 1,024-token contexts (CUDA graphs, ``bench_gpu.bench_decode``) and its
fraction of HBM bandwidth (weights read, for a mixture of experts only the experts the
batch routes to, plus the KV read). For a mixture of experts also one layer's experts
alone (``bench_experts.py``): the fused Triton kernel's small-batch and grouped paths,
eager and in a CUDA graph, against the roofline of the active experts' weights and the
per-expert loop (the CPU path), at batch 1, 4, 8, 16 and 32. ``--experts-only`` skips the
decode step.

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
from pathlib import Path

import torch
from bench_experts import bench_experts
from bench_gpu import _driver_version, bench_decode, gpu_name

MODELS = ("llama-3.1-8b", "qwen3-8b", "mistral-7b-v0.3", "gemma-2-9b", "qwen3-30b-a3b")


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
    parser.add_argument(
        "--experts-only", action="store_true", help="only the MoE layer's experts, no decode"
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
        entry: dict = {}
        if not args.experts_only:
            entry["decode"] = bench_decode(
                batch_sizes=(1, 32), model=model, quantization=args.quantization
            )
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
