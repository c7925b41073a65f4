"""Where a graphed decode step's GPU time goes, per kernel, for one engine configuration
on one CUDA GPU (issue 27: what FP8 weights add around their GEMMs).

Llama-3.1-8B shapes, dummy weights; ``--batch`` requests of 32-token prompts decode
``--new-tokens`` tokens twice (a warm-up and a timed run, both under torch.profiler, whose
kernels inside CUDA graphs are reported one by one). Prints the output tok/s of the
timed run and the 30 kernels with the most device time, in microseconds per decode step;
``--json-out`` keeps both. After ``--``, ``--quantization`` and ``--kv-cache-dtype`` go to
the engine as ``kvflow serve``'s (``fp8``, ``fp8_e4m3``); other flags are refused.

    python3 -P benchmarks/profile_decode.py --batch 128 --json-out bf16.json
    python3 -P benchmarks/profile_decode.py --batch 128 --json-out fp8.json -- --quantization fp8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_gpu import gpu_name, make_engine
from bench_lora_gpu import decode_rate, kernel_profile

ENGINE_FLAGS = ("--quantization", "--kv-cache-dtype")  # string-valued: passed as given


def engine_flags(extra: list[str]) -> dict[str, str]:
    """``--name value`` pairs of :data:`ENGINE_FLAGS` as the engine's keyword arguments
    (``name`` with ``_``)."""
    if len(extra) % 2 or any(flag not in ENGINE_FLAGS for flag in extra[::2]):
        raise SystemExit(f"engine flags are {', '.join(ENGINE_FLAGS)} with a value, got {extra}")
    pairs = zip(extra[::2], extra[1::2], strict=True)
    return {flag[2:].replace("-", "_"): value for flag, value in pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json-out", type=Path)
    args, extra = parser.parse_known_args()
    flags = engine_flags([f for f in extra if f != "--"])
    engine = make_engine(max_running_requests=args.batch, **flags)
    kv_tokens = engine.runner.allocator.size
    rate = decode_rate(engine, args.batch, [None], args.new_tokens)
    print(f"{flags or 'bf16'} batch {args.batch}: {rate:.1f} tok/s; KV pool {kv_tokens} tokens",
          flush=True)  # fmt: skip
    kernels = kernel_profile(engine, args.batch, [None], args.new_tokens)
    if args.json_out:
        result = {"gpu": gpu_name(), "flags": flags, "batch": args.batch, "kv_tokens": kv_tokens,
                  "new_tokens": args.new_tokens, "output_tok_s": rate, "kernels": kernels}  # fmt: skip
        args.json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
