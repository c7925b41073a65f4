"""Speculative decoding: output tok/s at one stream with and without speculation.

``cpu`` (default, ``make bench-spec``): the embedded SmolLM2-135M on this machine, NGRAM
against no speculation on two workloads, greedy, one request at a time, rounds interleaved
(each round runs both engines on every prompt, in alternating order) so load from other
work on a shared machine hits both alike. ``quote`` asks the model to repeat code with one
change (the output quotes the prompt); ``fresh`` asks open questions (it does not). Each
request's tok/s is its output tokens over its wall time (prefill included, the prefix cache
flushed before it). Every speculative output is checked against the plain one, token for
token.

``gpu`` (for the accelerator machine): Llama-3.1-8B shapes with random weights in bf16,
one stream. Rows: the plain decode step; a STANDALONE draft from the same config with
fewer layers; an EAGLE head (one layer, random weights) of the same shapes, as it drafts
and with every draft kept (forced, below), and an EAGLE-3 head with every draft kept, each
with the drafter's decode steps in its CUDA graphs and again with them detached (eager
draft forwards, the verify step still graphed; ``--skip-draft-eager`` skips those); and
a labelled *forced* mode where the drafter proposes the target's own
greedy continuation for the first ``a - 1`` drafts and a wrong token after them, so each
verify step keeps ``a`` tokens (a = 1..4; the measured accept length is printed beside it,
since bf16 extend and decode numerics may differ on a rare token). ``--device cpu --model
CONFIG`` runs the same code on a tiny config anywhere (a dry run).

    python -P benchmarks/bench_spec.py cpu --out benchmarks/results/spec.md
    python -P benchmarks/bench_spec.py gpu  # writes benchmarks/results/spec-gpu.{md,json}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvflow.runtime.speculative import Drafter

CODE = [
    "def area(width, height):\n    return width * height\n\n\nprint(area(3, 4))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'even')\n    else:\n"
    "        print(i, 'odd')\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n"
    "    def increment(self):\n        self.count += 1\n        return self.count\n",
]
CHANGES = ["rename width to w", "print 'even number' instead of 'even'", "rename count to total"]
QUOTE = [
    f"Repeat this code with one change ({change}). Reply with the code only.\n\n{code}"
    for code, change in zip(CODE, CHANGES, strict=True)
]
FRESH = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten year old.",
    "Give me three ideas for a weekend trip and why each is fun.",
]


def _chat(engine: Any, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    prompt = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return engine.encode(prompt)


def _one(engine: Any, ids: list[int], max_new: int) -> tuple[list[int], float]:
    engine.flush_cache()
    began = time.perf_counter()
    result = engine.generate(
        input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": max_new}
    )
    return result.output_ids, time.perf_counter() - began


def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    from kvflow.runtime.engine import Engine

    common: dict[str, Any] = {"cpu_kv_cache_gb": 0.25, "max_running_requests": 4}
    engines = {
        "plain": Engine(**common),
        "ngram": Engine(
            speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=args.num_draft_tokens,
            **common,
        ),
    }
    workloads = {"quote": QUOTE, "fresh": FRESH}
    prompts = {w: [_chat(engines["plain"], t) for t in texts] for w, texts in workloads.items()}
    for engine in engines.values():  # warm-up
        _one(engine, prompts["fresh"][0], 8)
    samples: dict[str, dict[str, list[float]]] = {w: {m: [] for m in engines} for w in workloads}
    mismatches = 0
    for round_no in range(args.rounds):
        order = list(engines) if round_no % 2 == 0 else list(reversed(engines))
        for workload, ids_list in prompts.items():
            for ids in ids_list:
                outputs = {}
                for mode in order:
                    out, seconds = _one(engines[mode], ids, args.max_new_tokens)
                    outputs[mode] = out
                    samples[workload][mode].append(len(out) / seconds)
                mismatches += outputs["plain"] != outputs["ngram"]
        print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
    spec = engines["ngram"].scheduler.spec
    assert spec is not None
    report: dict[str, Any] = {
        "mode": "cpu",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average_1m": os.getloadavg()[0],
        "rounds": args.rounds,
        "max_new_tokens": args.max_new_tokens,
        "num_draft_tokens": args.num_draft_tokens,
        "outputs_differing": mismatches,
        "spec_accept_length": spec.accept_length,
        "drafted_tokens": spec.drafted_tokens,
        "accepted_tokens": spec.accepted_tokens,
        "workloads": {},
    }
    for workload, by_mode in samples.items():
        plain, ngram = by_mode["plain"], by_mode["ngram"]
        ratios = [n / p for n, p in zip(ngram, plain, strict=True)]
        report["workloads"][workload] = {
            "plain_tok_s_median": statistics.median(plain),
            "ngram_tok_s_median": statistics.median(ngram),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "plain_tok_s": plain,
            "ngram_tok_s": ngram,
        }
    return report


class ForcedDrafter(Drafter):
    """Benchmark mode only: drafts as many tokens as allowed (the plain run's continuation,
    shifted by one: what they are does not matter under `forced_accept`)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], vocab: int):
        self.reference, self.vocab = reference, vocab

    def propose(self, reqs: Sequence[Any], max_drafts: Sequence[int]) -> list[list[int]]:
        drafts = []
        for req, limit in zip(reqs, max_drafts, strict=True):
            ref = self.reference[tuple(req.origin_input_ids)]
            done = len(req.output_ids)
            drafts.append([(t + 1) % self.vocab for t in ref[done : done + limit]])
        return drafts


def forced_accept(worker: Any, accept: int) -> Any:
    """Benchmark mode only: a verify step keeps exactly ``accept - 1`` drafts and the
    target's own token after them, whatever the logits say. Random weights give nearly
    tied logits whose argmax flips between the verify (extend) and decode kernels' bf16
    rounding, so no drafter can be right by construction; this measures what a verify
    step costs and yields at each accept length, not a model's skill."""
    from kvflow.runtime.scheduler.verify import StepTokens

    def accept_forced(req: Any, tree: Any, rows: Any) -> Any:
        draft = list(tree.tokens)  # a chain (the verify step passes a DraftTree)
        kept = min(accept - 1, len(draft))
        tokens = [*draft[:kept], int(rows[kept].argmax())]
        worker.drafted_tokens += len(draft)
        worker.accepted_tokens += kept
        return StepTokens(tokens, [None] * len(tokens), [None] * len(tokens), len(draft))

    return accept_forced


def _decode_rate(engine: Any, prompt: list[int], new_tokens: int) -> tuple[float, int, list[int]]:
    """(decode tok/s at one stream, forward steps of the decode part, output ids): the
    time of ``new_tokens`` minus that of 1 token (the prefill), best of 2."""
    params = {"temperature": 0, "ignore_eos": True}

    def timed(n: int) -> tuple[float, int, list[int]]:
        engine.flush_cache()
        steps = engine.scheduler.forward_steps
        began = time.perf_counter()
        result = engine.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": n})
        _sync(engine)
        return (
            time.perf_counter() - began,
            engine.scheduler.forward_steps - steps,
            result.output_ids,
        )

    prefill = min(timed(1)[0] for _ in range(2))
    runs = [timed(new_tokens) for _ in range(2)]
    seconds, steps, ids = min(runs)
    return (new_tokens - 1) / max(seconds - prefill, 1e-9), steps - 1, ids


def _sync(engine: Any) -> None:
    if engine.runner.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _drafting_rows(
    engine: Any,
    label: str,
    accepts: Sequence[int | None],
    prompt: list[int],
    reference: list[int],
    args: argparse.Namespace,
    eager_too: bool = False,
) -> list[dict[str, Any]]:
    """A drafter's rows: as it drafts (``None``) or with every verify step keeping ``a``
    tokens (forced, the head still drafting), its decode steps in its CUDA graphs, then,
    unless ``--skip-draft-eager`` (and not ``eager_too``), the same with the drafter's
    graphs detached (eager draft forwards, the verify step still graphed)."""
    worker = engine.scheduler.spec
    assert worker is not None
    accept_plain = worker._accept
    graphs = getattr(worker.drafter, "graphs", None)
    rows: list[dict[str, Any]] = []
    skip_eager = args.skip_draft_eager and not eager_too
    runs = [graphs] if graphs is None or skip_eager else [graphs, None]
    for attached in runs:
        worker.drafter.graphs = attached
        for accept in accepts:
            worker._accept = (  # type: ignore[method-assign]
                accept_plain if accept is None else forced_accept(worker, accept)
            )
            before = (worker.verified_reqs, worker.emitted_tokens)
            replays = attached.replays if attached is not None else 0
            rate, steps, ids = _decode_rate(engine, prompt, args.output_len)
            verified = worker.verified_reqs - before[0]
            mode = label if accept is None else f"{label}, forced accept length {accept}"
            row = {
                "mode": f"{mode} ({'draft eager' if attached is None else 'draft graphs'})",
                "draft_graphs": attached is not None,
                "draft_replays": (attached.replays if attached is not None else 0) - replays,
                "tok_s": rate,
                "steps": steps,
                "measured_accept_length": (worker.emitted_tokens - before[1]) / max(verified, 1),
                "ms_per_step": 1e3 * (args.output_len - 1) / rate / max(steps, 1),
            }
            if accept is None:
                row["same_tokens_as_plain"] = ids == reference
            rows.append(row)
    worker.drafter.graphs, worker._accept = graphs, accept_plain
    return rows


def run_gpu(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    import torch

    from kvflow.runtime.config import DUMMY_CONFIGS
    from kvflow.runtime.engine import Engine

    model = str(DUMMY_CONFIGS.get(args.model, args.model))
    raw = json.loads(Path(model).read_text())
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": args.draft_layers}))
    # an EAGLE-1/2 head of the same shapes, no weights file: random like the target
    head = Path(tempfile.mkdtemp())
    head_raw = {**raw, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle"]}
    (head / "config.json").write_text(json.dumps(head_raw))
    head3 = Path(tempfile.mkdtemp())  # EAGLE-3: the target's vocabulary, default layers
    head3_raw = {**head_raw, "architectures": ["LlamaForCausalLMEagle3"]}
    (head3 / "config.json").write_text(json.dumps(head3_raw))
    settings = {
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "device": args.device,
        "dtype": "bfloat16" if args.device == "cuda" else "float32",
        "max_total_tokens": 16384,
        "max_running_requests": 8,
    }
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, raw["vocab_size"] - 1, (args.input_len,), generator=g).tolist()
    rows: list[dict[str, Any]] = []

    plain = Engine(model, **settings)
    rate, steps, reference = _decode_rate(plain, prompt, args.output_len)
    rows.append({"mode": "plain decode (CUDA graphs on)", "tok_s": rate, "steps": steps,
                 "ms_per_step": 1e3 * (args.output_len - 1) / rate / steps})  # fmt: skip
    del plain
    gc.collect()
    # eager decode, for reference (the speculative engines' verify steps replay graphs)
    eager = Engine(model, **settings, disable_cuda_graph=True)
    rate, steps, _ = _decode_rate(eager, prompt, args.output_len)
    rows.append({"mode": "plain decode (eager)", "tok_s": rate, "steps": steps,
                 "ms_per_step": 1e3 * (args.output_len - 1) / rate / steps})  # fmt: skip
    del eager
    gc.collect()

    k = args.num_draft_tokens
    spec = Engine(model, **settings, speculative_algorithm="NGRAM", speculative_num_draft_tokens=k)
    worker = spec.scheduler.spec
    assert worker is not None
    worker.drafter = ForcedDrafter({tuple(prompt): reference}, raw["vocab_size"])
    for accept in range(1, k + 1):
        worker._accept = forced_accept(worker, accept)  # type: ignore[method-assign]
        before = (worker.verified_reqs, worker.emitted_tokens)
        rate, steps, _ = _decode_rate(spec, prompt, args.output_len)
        verified = worker.verified_reqs - before[0]
        measured = (worker.emitted_tokens - before[1]) / max(verified, 1)
        rows.append({"mode": f"forced accept length {accept} ({k - 1} drafts verified)",
                     "tok_s": rate, "steps": steps, "measured_accept_length": measured,
                     "ms_per_step": 1e3 * (args.output_len - 1) / rate / max(steps, 1)})  # fmt: skip
    del spec, worker
    gc.collect()

    # label, engine arguments, forced accept lengths (None: as it drafts), eager rows too
    drafting: dict[str, tuple[str, dict[str, Any], list[int | None], bool]] = {
        "standalone": (
            f"STANDALONE, {args.draft_layers}-layer draft of the same config",
            {"speculative_algorithm": "STANDALONE",
             "speculative_draft_model_path": str(folder / "config.json")},
            [None],
            False,
        ),
        "eagle": (
            "EAGLE, 1-layer head (random weights)",
            {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(head)},
            [None, k],
            False,
        ),
        "eagle-tree": (
            "EAGLE tree (top-k 4, 8 draft tokens), 1-layer head (random weights)",
            {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(head),
             "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8},
            [None],
            True,  # the frontiers' graphs against eager frontiers
        ),
        "eagle3": (
            "EAGLE3, 1-layer head (random weights)",
            {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(head3)},
            [k],
            False,
        ),
    }  # fmt: skip
    for label, spec_args, accepts, eager_too in drafting.values():
        engine = Engine(model, **settings, **spec_args, speculative_num_steps=k - 1)
        rows += _drafting_rows(engine, label, accepts, prompt, reference, args, eager_too)
        del engine
        gc.collect()
    return {
        "mode": "gpu",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "model": args.model,
        "dtype": settings["dtype"],
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_draft_tokens": k,
        "rows": rows,
    }


def _markdown_cpu(report: dict[str, Any], command: str) -> str:
    lines = [
        "# Speculative decoding on CPU: NGRAM vs no speculation",
        "",
        f"Command: `{command}`  ",
        f"Machine: {report['machine']}, shared with other work (1-minute load average at the "
        f"end: {report['load_average_1m']:.2f}); the embedded SmolLM2-135M-Instruct, float32, "
        f"greedy, one stream, {report['max_new_tokens']} new tokens at most, "
        f"`--speculative-num-draft-tokens {report['num_draft_tokens']}`, "
        f"{report['rounds']} interleaved rounds.",
        "",
        "| workload | no speculation tok/s (median) | NGRAM tok/s (median) | ratio (median of per-request) | ratio (min) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, w in report["workloads"].items():
        lines.append(
            f"| {name} | {w['plain_tok_s_median']:.1f} | {w['ngram_tok_s_median']:.1f} | "
            f"{w['ratio_median']:.2f}x | {w['ratio_min']:.2f}x |"
        )
    lines += [
        "",
        f"Outputs that differ from the plain engine's (token for token): "
        f"{report['outputs_differing']}. NGRAM's `spec_accept_length` over the whole run "
        f"(both workloads): {report['spec_accept_length']:.2f}; drafts "
        f"{report['drafted_tokens']}, accepted {report['accepted_tokens']}.",
        "",
        "`quote` asks to repeat a code snippet with one change (the output quotes the "
        "prompt); `fresh` asks open questions. tok/s = output tokens / wall time of the "
        "request (prefill included, prefix cache flushed before each).",
        "",
        "Raw JSON:",
        "",
        "```json",
        json.dumps(report, indent=2),
        "```",
        "",
    ]
    return "\n".join(lines)


def _markdown_gpu(report: dict[str, Any]) -> str:
    lines = [
        "# Speculative decoding on GPU: verify-step cost and forced accept lengths",
        "",
        f"Command: `{report['command']}`  ",
        f"Device: {report['device']}; {report['model']} shapes, random weights, {report['dtype']}, one "
        f"stream, {report['input_len']}-token prompt, {report['output_len']} new tokens, "
        f"`--speculative-num-draft-tokens {report['num_draft_tokens']}`. The forced rows are "
        "a benchmark mode (`forced_accept`): every verify step scores the full draft and "
        "keeps exactly a - 1 drafts plus the target's own token, whatever the logits say, "
        "so the row shows what a verify step costs and yields at accept length a. Random "
        "weights give nearly tied logits, whose argmax can differ between the verify "
        "(extend) and decode kernels' bf16 rounding: `same tokens as plain` is reported "
        "for STANDALONE, not asserted.",
        "",
        "| mode | decode tok/s | ms per step | measured accept length | same tokens as plain |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in report["rows"]:
        accept = row.get("measured_accept_length")
        same = row.get("same_tokens_as_plain")
        lines.append(
            f"| {row['mode']} | {row['tok_s']:.1f} | {row['ms_per_step']:.2f} | "
            f"{'-' if accept is None else f'{accept:.2f}'} | {'-' if same is None else same} |"
        )
    lines += ["", "Raw JSON:", "", "```json", json.dumps(report, indent=2), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode")
    cpu = sub.add_parser("cpu", help="NGRAM vs none on the embedded model (this machine)")
    cpu.add_argument("--rounds", type=int, default=3)
    cpu.add_argument("--max-new-tokens", type=int, default=96)
    cpu.add_argument("--num-draft-tokens", type=int, default=8)
    cpu.add_argument("--out", default="benchmarks/results/spec.md")
    gpu = sub.add_parser("gpu", help="Llama-3.1-8B shapes: verify cost, forced accept lengths")
    gpu.add_argument(
        "--model", default="llama-3.1-8b", help="a shipped config name or a config.json"
    )
    gpu.add_argument("--device", default="cuda")
    gpu.add_argument("--draft-layers", type=int, default=2)
    gpu.add_argument("--input-len", type=int, default=512)
    gpu.add_argument("--output-len", type=int, default=128)
    gpu.add_argument("--num-draft-tokens", type=int, default=4)
    gpu.add_argument(
        "--skip-draft-eager",
        action="store_true",
        help="measure the drafters with their CUDA graphs only (not also with eager drafts)",
    )
    gpu.add_argument("--json-out", default="benchmarks/results/spec-gpu.json")
    gpu.add_argument("--md-out", default="benchmarks/results/spec-gpu.md")
    args = parser.parse_args(argv)
    command = "python -P benchmarks/bench_spec.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    if args.mode == "gpu":
        report = run_gpu(args)
        report["command"] = command
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        Path(args.md_out).write_text(_markdown_gpu(report))
        print(json.dumps(report, indent=2))
        return 0
    if args.mode is None:
        args = parser.parse_args(["cpu", *(argv or [])])
    report = run_cpu(args)
    Path(args.out).write_text(_markdown_cpu(report, command))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
