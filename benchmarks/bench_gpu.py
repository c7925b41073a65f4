"""GPU benchmarks with Llama-3.1-8B shapes (random bf16 weights, EOS ignored).

    python benchmarks/bench_gpu.py all --out benchmarks/results/gpu.md

Parts (each also runs alone: ``decode``, ``prefill``, ``throughput``, ``online``, ``peer``):

- decode: step latency at batch 1/8/32/64/128 with 1024-token contexts (CUDA graphs), and
  the HBM bandwidth fraction ``(weight bytes + KV bytes read) / step time / peak``.
- prefill: one 4096-token prompt; model FLOP utilization against the dense bf16 peak.
- throughput: SGLang's CI workload through the offline engine: 500 prompts, input lengths
  uniform in [1, 4096], outputs uniform in [1, 2048], all submitted at once.
- online: 100 such prompts arriving as a Poisson process at 1 request/s, replayed into the
  engine's scheduler loop (no HTTP): median TTFT and inter-token latency.
- peer: transformers ``generate_batch`` (paged|sdpa, its continuous batching) against kvflow
  on the same 64 prompts (input lengths as above) with 256 output tokens each.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import statistics
import time
from pathlib import Path

import torch

PEAK_BW = {"H100": 3.35e12, "H200": 4.8e12}
PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16
MODEL = "llama-3.1-8b"
ENGINE_ARGS: dict = {}  # from the command line (--quantization, --kv-cache-dtype), every part


def gpu_name() -> str:
    return torch.cuda.get_device_name(0)


def peak_bw() -> float:
    return next((bw for key, bw in PEAK_BW.items() if key in gpu_name()), 3.35e12)


def time_cuda(fn, iters: int, warmup: int = 1) -> float:
    """Seconds per call of ``fn`` on the GPU: ``warmup`` calls, then ``iters`` timed between
    two synchronizations."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def make_engine(model: str = MODEL, **kwargs):
    from kvflow.runtime.engine import Engine

    defaults = dict(load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, device="cuda")
    return Engine(model, **{**defaults, **ENGINE_ARGS, **kwargs})


def param_bytes(engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


def admit_decode_batch(engine, bs: int, context: int, steps: int, rng: random.Random) -> list:
    """``bs`` requests of ``context`` random tokens prefilled into ``engine``'s scheduler
    and decoding (three warm steps taken), room for ``2 * steps`` more tokens each."""
    from kvflow.runtime.sampling import SamplingParams
    from kvflow.runtime.scheduler import Req
    from kvflow.runtime.wire import GenerateRequest

    sched, vocab = engine.scheduler, engine.runner.model_config.vocab_size
    params = SamplingParams(temperature=0, max_new_tokens=2 * steps + 10, ignore_eos=True)
    reqs = [
        Req(
            GenerateRequest(
                rid=f"d{bs}-{i}", input_ids=random_ids(rng, context, vocab), sampling=params
            )
        )
        for i in range(bs)
    ]
    for req in reqs:
        sched.add_request(req)
    while sched.waiting or sched.chunked:
        sched.step()
    for _ in range(3):
        sched.step()  # warm decode
    return reqs


def weight_bytes_read(engine, bs: int) -> float:
    """Weight bytes a decode step of ``bs`` rows reads: every parameter of a dense model;
    for a mixture of experts, the dense part plus the experts the batch is expected to
    route to (uniform routing over ``E`` experts, ``k`` per token: ``E * (1 - (1 - k/E)^bs)``
    per layer, the dummy router's random weights being close to uniform)."""
    total = param_bytes(engine)
    mc = engine.runner.model_config
    experts = getattr(mc, "num_experts", 0) or 0
    if not experts:
        return float(total)
    expert_bytes = sum(
        p.numel() * p.element_size()
        for name, p in engine.runner.model.named_parameters()
        if ".experts." in name or name.endswith(("w13", "w2"))
    )
    top_k = mc.num_experts_per_tok
    expected = experts * (1 - (1 - top_k / experts) ** bs)
    return total - expert_bytes + expert_bytes * expected / experts


def bench_decode(
    batch_sizes=(1, 8, 32, 64, 128),
    context=1024,
    steps=30,
    model: str = MODEL,
    quantization: str | None = None,
) -> list[dict]:
    quant = {} if quantization is None else {"quantization": quantization}  # else ENGINE_ARGS'
    engine = make_engine(
        model,
        **quant,
        max_running_requests=max(batch_sizes),
        cuda_graph_max_bs=max(batch_sizes),
        chunked_prefill_size=16384,
        max_prefill_tokens=16384,
    )
    sched, mc = engine.scheduler, engine.runner.model_config
    kv_bytes = engine.runner.kv_pool.k_buffer[0].element_size()  # 1 with an FP8 KV cache
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * kv_bytes
    rng = random.Random(0)
    rows = []
    for bs in batch_sizes:
        reqs = admit_decode_batch(engine, bs, context, steps, rng)

        def time_steps() -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                sched.step()
            torch.cuda.synchronize()
            return (time.perf_counter() - start) / steps

        # The scheduler as shipped, then without building step N+1 before step N's tokens
        # are on the host (the GPU idles while Python schedules).
        step_s = time_steps()
        sched.prepare_next_decode = False
        unprepared_s = time_steps()
        sched.prepare_next_decode = True
        # The same batch through the captured graph alone: the GPU's share of a step.
        from kvflow.runtime.scheduler.batch import build_decode_batch

        fb = build_decode_batch(
            sched.running,
            engine.runner.req_to_token.read(sched.running[0].req_pool_idx, 1).repeat(bs),
            engine.runner.device,
        )
        engine.runner.forward(fb)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.runner.forward(fb)
        torch.cuda.synchronize()
        forward_s = (time.perf_counter() - start) / steps
        moved = weight_bytes_read(engine, bs) + bs * (context + 8) * kv_per_token
        rows.append(
            {
                "batch": bs,
                "step_ms": step_s * 1e3,
                "step_unprepared_ms": unprepared_s * 1e3,
                "hbm_fraction": moved / step_s / peak_bw(),
                "forward_only_ms": forward_s * 1e3,
                "tokens_per_s": bs / step_s,
            }
        )
        for req in reqs:
            sched.abort_request(req.rid)
        assert engine.is_memory_free()
    return rows


def bench_prefill(length=4096, repeats=5) -> dict:
    from kvflow.runtime.sampling import SamplingParams
    from kvflow.runtime.scheduler import Req
    from kvflow.runtime.wire import GenerateRequest

    engine = make_engine(
        chunked_prefill_size=length, max_prefill_tokens=length, disable_radix_cache=True
    )
    sched, mc = engine.scheduler, engine.runner.model_config
    rng = random.Random(1)
    times = []
    for i in range(repeats + 1):
        req = Req(
            GenerateRequest(
                rid=f"p{i}",
                input_ids=random_ids(rng, length, mc.vocab_size),
                sampling=SamplingParams(max_new_tokens=1, temperature=0),
            )
        )
        sched.add_request(req)
        torch.cuda.synchronize()
        start = time.perf_counter()
        sched.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        assert req.finished
    seconds = statistics.median(times[1:])
    matmul_params = sum(
        p.numel() for n, p in engine.runner.model.named_parameters() if "embed" not in n
    )
    attn_flops = (
        2 * mc.num_layers * mc.num_heads * mc.head_dim * length * length
    )  # causal QK^T + PV
    flops = 2 * matmul_params * length + attn_flops
    return {
        "tokens": length,
        "seconds": seconds,
        "tflops": flops / seconds / 1e12,
        "mfu": flops / seconds / PEAK_BF16_FLOPS,
    }


def ci_workload(count: int, seed: int = 0, vocab: int = 128256):
    rng = random.Random(seed)
    return [
        (random_ids(rng, rng.randint(1, 4096), vocab), rng.randint(1, 2048)) for _ in range(count)
    ]


def bench_throughput(count=500) -> dict:
    engine = make_engine(max_running_requests=256, cuda_graph_max_bs=256)
    work = ci_workload(count)
    engine.generate(
        input_ids=[ids for ids, _ in work[:8]],
        sampling_params=[{"max_new_tokens": 8, "ignore_eos": True}] * 8,
    )
    engine.flush_cache()
    start = time.perf_counter()
    results = engine.generate(
        input_ids=[ids for ids, _ in work],
        sampling_params=[
            {"max_new_tokens": n, "ignore_eos": True, "temperature": 0} for _, n in work
        ],
    )
    seconds = time.perf_counter() - start
    out_tokens = sum(len(r.output_ids) for r in results)
    return {
        "requests": count,
        "seconds": seconds,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / seconds,
        "retractions": engine.scheduler.num_retractions,
        "kv_pool_tokens": engine.runner.allocator.size,
    }


def bench_online(count=100, rate=1.0) -> dict:
    from kvflow.runtime.sampling import SamplingParams
    from kvflow.runtime.scheduler import Req
    from kvflow.runtime.wire import GenerateRequest

    engine = make_engine(max_running_requests=256, cuda_graph_max_bs=256)
    sched = engine.scheduler
    rng = random.Random(2)
    work = ci_workload(count, seed=3)
    arrivals, t = [], 0.0
    for _ in work:
        t += rng.expovariate(rate)
        arrivals.append(t)
    reqs = [
        Req(
            GenerateRequest(
                rid=f"o{i}",
                input_ids=ids,
                sampling=SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0),
            )
        )
        for i, (ids, n) in enumerate(work)
    ]
    token_times: dict[str, list[float]] = {r.rid: [] for r in reqs}
    start = time.perf_counter()
    nxt = 0
    while nxt < count or sched.has_work():
        now = time.perf_counter() - start
        while nxt < count and arrivals[nxt] <= now:
            sched.add_request(reqs[nxt])
            nxt += 1
        if not sched.has_work():
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - start)))
            continue
        outs = sched.step()
        stamp = time.perf_counter() - start
        for out in outs:
            token_times[out.rid] += [stamp] * len(out.new_token_ids)
    ttft = [token_times[r.rid][0] - a for r, a in zip(reqs, arrivals, strict=True)]
    itl = [b - a for times in token_times.values() for a, b in itertools.pairwise(times)]
    return {
        "requests": count,
        "rate": rate,
        "median_ttft_ms": statistics.median(ttft) * 1e3,
        "p99_ttft_ms": sorted(ttft)[int(0.99 * len(ttft)) - 1] * 1e3,
        "median_itl_ms": statistics.median(itl) * 1e3,
        "p99_itl_ms": sorted(itl)[int(0.99 * len(itl)) - 1] * 1e3,
    }


def bench_peer(count=64, output_len=256) -> dict:
    """Both engines on the same prompts (input lengths uniform in [1, 4096]) with a fixed
    output length: transformers' ``generate_batch`` takes one ``max_new_tokens`` per call."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from kvflow.runtime.config import DUMMY_CONFIGS

    prompts = [ids for ids, _ in ci_workload(count, seed=4)]
    raw = json.loads(DUMMY_CONFIGS[MODEL].read_text())
    with torch.device("cuda"):
        hf = LlamaForCausalLM(LlamaConfig(**raw)).to(torch.bfloat16).eval()
    hf.set_attn_implementation("paged|sdpa")
    gen = GenerationConfig(max_new_tokens=output_len, do_sample=False, pad_token_id=0)
    hf.generate_batch(inputs=prompts[:2], generation_config=gen)  # warm up
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = hf.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize()
    hf_seconds = time.perf_counter() - start
    hf_tokens = sum(len(o.generated_tokens) for o in out.values())
    del hf, out
    gc.collect()
    torch.cuda.empty_cache()
    engine = make_engine(max_running_requests=256, cuda_graph_max_bs=256)
    params = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0}
    engine.generate(input_ids=prompts[:2], sampling_params=params)
    engine.flush_cache()
    start = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=params)
    kv_seconds = time.perf_counter() - start
    kv_tokens = sum(len(r.output_ids) for r in results)
    return {
        "requests": count,
        "output_len": output_len,
        "transformers_tok_s": hf_tokens / hf_seconds,
        "kvflow_tok_s": kv_tokens / kv_seconds,
        "ratio": (kv_tokens / kv_seconds) / (hf_tokens / hf_seconds),
        "transformers_tokens": hf_tokens,
        "kvflow_tokens": kv_tokens,
    }


def _driver_version() -> str:
    import subprocess

    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() or "unknown"


PARTS = {
    "decode": bench_decode,
    "prefill": bench_prefill,
    "throughput": bench_throughput,
    "online": bench_online,
    "peer": bench_peer,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+", choices=[*PARTS, "all"])
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument(
        "--profile", action="store_true", help="cProfile each part (top 30 by own time)"
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="override the request count of throughput/online/peer",
    )
    parser.add_argument(
        "--quantization", default=None, help="as kvflow serve's (fp8: weights quantized at load)"
    )
    parser.add_argument("--kv-cache-dtype", default=None, help="as kvflow serve's (fp8_e4m3)")
    parser.add_argument(
        "--batch-sizes", default=None, help="decode's batch sizes, comma-separated (1,32,128)"
    )
    args = parser.parse_args()
    for key in ("quantization", "kv_cache_dtype"):
        if getattr(args, key) is not None:
            ENGINE_ARGS[key] = getattr(args, key)
    parts = list(PARTS) if "all" in args.parts else args.parts
    import triton

    results = {
        "gpu": gpu_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "driver": _driver_version(),
        "engine_args": ENGINE_ARGS,
    }
    for part in parts:
        started = time.perf_counter()
        kwargs = (
            {"count": args.requests}
            if args.requests and part in ("throughput", "online", "peer")
            else {}
        )
        if args.batch_sizes and part == "decode":
            kwargs["batch_sizes"] = tuple(int(b) for b in args.batch_sizes.split(","))
        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            results[part] = profiler.runcall(PARTS[part], **kwargs)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        else:
            results[part] = PARTS[part](**kwargs)
        gc.collect()  # the part's engine (KV pool, CUDA graphs) must go before the next one
        torch.cuda.empty_cache()
        print(
            part,
            json.dumps(results[part], indent=1),
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        if args.json_out:
            args.json_out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
