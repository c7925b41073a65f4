"""Offline throughput: ``kvflow.Engine.generate`` vs transformers ``generate`` in batch.

Same machine, same model (the embedded SmolLM2-135M-Instruct in float32), same 64 chat
prompts, same number of output tokens per prompt (EOS ignored on both sides), greedy.
Each side runs once to warm up on a few prompts, then is timed over all prompts; the
result is written as markdown with the command and the machine.

    python benchmarks/bench_offline.py --num-prompts 64 --output-len 64 --out benchmarks/results/offline.md
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

TOPICS = [
    "the ocean",
    "a robot",
    "mountains",
    "coffee",
    "the moon",
    "a library",
    "trains",
    "winter",
    "bees",
    "a lighthouse",
    "jazz",
    "deserts",
    "volcanoes",
    "chess",
    "rain",
    "bridges",
]
STYLES = [
    "Write a short poem about {}.",
    "Explain {} to a child.",
    "Give three facts about {}.",
    "Describe {} in one paragraph, with vivid detail and a surprising ending.",
]


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        text = STYLES[i % len(STYLES)].format(TOPICS[i % len(TOPICS)])
        chat = [{"role": "user", "content": text}]
        prompts.append(
            tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        )
    return [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]


def run_kvflow(model_path: str, prompts: list[list[int]], output_len: int) -> float:
    from kvflow.runtime.engine import Engine

    engine = Engine(model_path)
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    engine.generate(input_ids=prompts[:4], sampling_params=params)
    engine.flush_cache()  # no prefix-cache advantage from the warm-up
    start = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    assert all(len(r.output_ids) == output_len for r in results)
    return elapsed


def run_transformers(
    model_path: str, prompts: list[list[int]], output_len: int, batch_size: int
) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    def generate(batch: list[list[int]]) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + output_len

    generate(prompts[:4])
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        generate(prompts[i : i + batch_size])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/offline.md"))
    args = parser.parse_args()

    from kvflow.runtime.models import embedded_model_path
    from kvflow.runtime.tokenizer import load_tokenizer

    model_path = str(embedded_model_path())
    prompts = make_prompts(load_tokenizer(Path(model_path)), args.num_prompts)
    total_out = args.num_prompts * args.output_len
    load_before = os.getloadavg()[0]
    kv_time = run_kvflow(model_path, prompts, args.output_len)
    hf_time = run_transformers(model_path, prompts, args.output_len, args.hf_batch_size)
    kv_tps, hf_tps = total_out / kv_time, total_out / hf_time
    lines = [
        "# Offline throughput: kvflow Engine vs transformers generate",
        "",
        f"Command: `python benchmarks/bench_offline.py --num-prompts {args.num_prompts} "
        f"--output-len {args.output_len} --hf-batch-size {args.hf_batch_size}`",
        "",
        f"Machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"torch {torch.__version__}, CPU, float32; load average before the run {load_before:.1f} "
        "(the machine is shared: compare the ratio, not the absolute numbers).",
        "",
        f"Workload: {args.num_prompts} chat prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
        f"{args.output_len} output tokens each (EOS ignored), greedy, embedded SmolLM2-135M-Instruct.",
        "",
        "| engine | wall time (s) | output tokens/s |",
        "| --- | ---: | ---: |",
        f"| kvflow `Engine.generate` (continuous batching) | {kv_time:.1f} | {kv_tps:.1f} |",
        f"| transformers `generate` (batch {args.hf_batch_size}, left padding) | {hf_time:.1f} | {hf_tps:.1f} |",
        "",
        f"**Ratio kvflow / transformers: {kv_tps / hf_tps:.2f}x**",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
