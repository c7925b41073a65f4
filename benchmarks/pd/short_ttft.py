"""PD's fixed cost per request: TTFT of short prompts sent one at a time, PD vs unified.

A tiny dummy Llama (4 layers, float32, from ``runtime/configs/llama-3.1-8b.json``, as
``PD_LOCAL=1 benchmarks/gpu_pd_interference.sh``) so the model's compute is small and what
is left of TTFT is the path: router, HTTP, the bootstrap room's claim and polls, the
decode's admission. Each round sends one fresh prompt of ids to each router (streamed
``/generate``, the order flipping every round); TTFT is the first event's arrival.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving import load_average

from .generate_stream import events
from .stack import pd_stack

__all__ = ["ShortTTFTConfig", "run_short_ttft", "tiny_llama"]

_BASE = Path(__file__).parents[2] / "runtime" / "configs" / "llama-3.1-8b.json"
_TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 32000,
    "torch_dtype": "float32",
}


@dataclass(frozen=True)
class ShortTTFTConfig:
    input_len: int = 32
    output_len: int = 8
    requests: int = 40  # per configuration, one at a time
    warmup: int = 4
    python: str = "python"
    log_dir: Path = Path("/tmp/kvflow-bench-pd-short")
    server_args: tuple[str, ...] = (
        "--load-format", "dummy", "--dtype", "float32", "--skip-tokenizer-init",
        "--context-length", "2048", "--max-total-tokens", "8000",
    )  # fmt: skip


def tiny_llama(folder: Path) -> Path:
    """The tiny model's config.json (dummy weights: no files but the config)."""
    config = {**json.loads(_BASE.read_text()), **_TINY}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def _ttft(port: int, prompt: list[int], output_len: int) -> float:
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True},
    }
    sent = time.monotonic()
    stream = events(port, body, timeout=60)
    first, _ = next(stream)
    for _ in stream:  # the rest, so the next request finds both servers idle
        pass
    return first - sent


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_ms": statistics.median(ordered) * 1e3,
        "mean_ms": statistics.fmean(ordered) * 1e3,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
        "min_ms": ordered[0] * 1e3,
    }


def run_short_ttft(cfg: ShortTTFTConfig) -> dict[str, Any]:
    """Both routers, the same prompts; the JSON-ready results with PD / unified at p50."""
    model = tiny_llama(cfg.log_dir / "tiny-llama")
    rng = random.Random(29)
    ttfts: dict[str, list[float]] = {"unified": [], "pd": []}
    load_before = load_average()
    with pd_stack(cfg.python, str(model), list(cfg.server_args), cfg.log_dir) as stack:
        ports = {
            "unified": int(stack.unified.rsplit(":", 1)[1]),
            "pd": int(stack.pd.rsplit(":", 1)[1]),
        }
        for index in range(cfg.warmup + cfg.requests):
            prompt = [rng.randrange(1000, 31000) for _ in range(cfg.input_len)]
            order = ("unified", "pd") if index % 2 == 0 else ("pd", "unified")
            for name in order:
                ttft = _ttft(ports[name], prompt, cfg.output_len)
                if index >= cfg.warmup:
                    ttfts[name].append(ttft)
    results = {name: _summary(values) for name, values in ttfts.items()}
    return {
        "input_len": cfg.input_len,
        "output_len": cfg.output_len,
        "requests": cfg.requests,
        "load_before": load_before,
        "load_after": load_average(),
        **results,
        "ratio_p50": results["pd"]["p50_ms"] / results["unified"]["p50_ms"],
        "raw_ms": {name: [round(v * 1e3, 2) for v in values] for name, values in ttfts.items()},
    }
