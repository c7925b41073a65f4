"""Multi-LoRA decode on the GPU: Llama-3.1-8B shapes (random bf16 weights), four random
rank-16 adapters on all seven projections, output tok/s of greedy decoding (short
prompts, 128 new tokens, EOS ignored) through ``Engine.generate`` at batch 1 and 32:

- base: no ``--enable-lora`` (the reference);
- lora-graphs base-only: ``--enable-lora``, decode CUDA graphs, no request on an adapter
  (what serving the base model costs once LoRA is on);
- lora-graphs mixed: the batch's requests cycle over the four adapters;
- lora-eager mixed: the same with ``--disable-cuda-graph`` (what LoRA cost before its
  decode ran in graphs).

    PYTHONPATH=benchmarks python -P benchmarks/bench_lora_gpu.py --json-out lora-gpu.json
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

MODEL = "llama-3.1-8b"
MODULES = {  # PEFT module -> (input width, output rows) in Llama-3.1-8B
    "q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024),
    "o_proj": (4096, 4096), "gate_proj": (4096, 14336), "up_proj": (4096, 14336),
    "down_proj": (14336, 4096),
}  # fmt: skip
ADAPTERS = ("a", "b", "c", "d")


def write_adapter(folder: Path, seed: int, rank: int = 16, layers: int = 32) -> None:
    """PEFT's files for a random adapter on every projection of every layer."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for name, (k, n) in MODULES.items():
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, k, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 32, "target_modules": list(MODULES)}
    (folder / "adapter_config.json").write_text(json.dumps({**config, "bias": "none"}))


def decode_rate(engine, bs: int, adapters: list[str | None], new_tokens: int = 128) -> float:
    """Output tok/s of ``bs`` 32-token prompts decoding ``new_tokens`` each (a warm-up run
    first, so graphs, kernels and adapter slots are warm)."""
    prompts = [[1000 + 7 * i + j for j in range(32)] for i in range(bs)]
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    paths = [adapters[i % len(adapters)] for i in range(bs)]
    engine.generate(input_ids=prompts, sampling_params=params, lora_path=paths)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params, lora_path=paths)
    torch.cuda.synchronize()
    return bs * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--batch-sizes", default="1,32")
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="kvflow-lora-bench-"))
    for seed, name in enumerate(ADAPTERS):
        write_adapter(root / name, seed)
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
    results: dict = {"gpu": gpu_name(), "torch": torch.__version__, "driver": _driver_version()}
    rows = []
    for label, kwargs, adapters in runs:
        engine = make_engine(MODEL, max_running_requests=max(sizes), **kwargs)
        for bs in sizes:
            rate = decode_rate(engine, bs, adapters)
            rows.append({"run": label, "batch": bs, "output_tok_s": rate})
            print(label, bs, f"{rate:.1f} tok/s", flush=True)
            if args.json_out:  # after every run: a call cut short keeps what it measured
                args.json_out.write_text(json.dumps({**results, "rows": rows}, indent=1))
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    base = {r["batch"]: r["output_tok_s"] for r in rows if r["run"] == "base"}
    for r in rows:
        r["vs_base"] = r["output_tok_s"] / base[r["batch"]]
    results["rows"] = rows
    print(json.dumps(rows, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
