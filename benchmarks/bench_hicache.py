"""HiCache benchmark (``make bench-hicache``): multi-turn TTFT with the tiers off and on, and
the first-request TTFT of a new instance against a warm shared store.

    python benchmarks/bench_hicache.py [--conversations 8] [--turns 4] [--device-tokens 1024]

``multiturn``: conversations with a long system document each, whose working set is about
4x the device KV pool (capped with ``--max-total-tokens``). Turn by turn every conversation
sends its history plus a new question (greedy, a fixed number of output tokens, the answer
appended to the history), ``--concurrency`` conversations at a time. Same prompts for each
configuration, one server at a time: HiCache off (radix cache only), L2 (host pool), L2 +
file store, L2 + Mooncake store (a real ``mooncake_master`` on loopback). TTFT p50/p90 over
turns >= 2 (turn 1 is cold everywhere) and output tok/s over the run.

``warm``: instance A (L2 + L3) answers one question on a long shared document; instance B,
started fresh against the same store while A is still up (a Mooncake store's pages live in
the memory its clients lend), answers another question on it: its TTFT against instance
C's, started against an empty store (cold).

Writes benchmarks/results/hicache.md and hicache.json. Everything binds 127.0.0.1; every
server and master started is stopped on exit; every request has a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from serving import machine_info
from serving.defaults import EMBEDDED_MODEL
from serving.servers import LaunchOptions, ServerSpec, _kvflow_argv, running_server
from serving.stats import percentile

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "hicache_storage"))
from l3_helpers import MooncakeMaster

PAGE_SIZE = "16"
TOPICS = [
    "rivers", "volcanoes", "bridges", "libraries", "glaciers", "orchards", "lighthouses",
    "deserts", "harbors", "forests", "canals", "mountains",
]  # fmt: skip
QUESTIONS = [
    "Summarize it in one line.", "Name one example.", "Why does it matter?",
    "What changed recently?", "Give a number from it.", "What is surprising?",
]  # fmt: skip


def document(topic: str, sentences: int) -> str:
    return " ".join(
        f"Note {i} on {topic}: {topic} vary by region, era and use, and record {i} says so."
        for i in range(sentences)
    )


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft: float
    tokens: int
    cached: int


@dataclass
class RunResult:
    name: str
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0
    errors: int = 0

    def summary(self) -> dict:
        later = [t.ttft for t in self.turns if t.turn >= 1]
        return {
            "config": self.name,
            "requests": len(self.turns),
            "errors": self.errors,
            "ttft_p50_ms": percentile(later, 50) * 1e3 if later else float("nan"),
            "ttft_p90_ms": percentile(later, 90) * 1e3 if later else float("nan"),
            "output_tok_s": sum(t.tokens for t in self.turns) / self.seconds,
            "cached_share": sum(t.cached for t in self.turns if t.turn >= 1)
            / max(1, sum(1 for t in self.turns if t.turn >= 1)),
        }


async def _chat(client: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> tuple:
    """Stream one chat completion: (ttft, text, output tokens, cached prompt tokens)."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent, ttft, text, usage = time.perf_counter(), None, [], {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    ttft = ttft if ttft is not None else time.perf_counter() - sent
                    text.append(delta)
            usage = event.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft or float("nan"), "".join(text), usage.get("completion_tokens", 0), cached


class Conversations:
    """Every conversation's history for one server; :meth:`turn` sends each its next
    question (``concurrency`` at a time) and appends the answers."""

    def __init__(self, url: str, args: argparse.Namespace, name: str) -> None:
        self.url, self.args = url, args
        self.result = RunResult(name)
        self.histories = [
            [
                {
                    "role": "system",
                    "content": f"You answer questions about {t}. {document(t, args.doc_sentences)}",
                }
            ]
            for t in TOPICS[: args.conversations]
        ]

    async def turn(self, turn: int) -> None:
        args, result = self.args, self.result
        limits = httpx.Limits(max_connections=args.concurrency + 2)
        async with httpx.AsyncClient(
            base_url=self.url, timeout=httpx.Timeout(600.0), limits=limits, trust_env=False
        ) as client:
            gate = asyncio.Semaphore(args.concurrency)

            async def one(index: int) -> None:
                async with gate:
                    history = self.histories[index]
                    history.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
                    try:
                        ttft, text, tokens, cached = await _chat(client, history, args.output_len)
                    except (httpx.HTTPError, RuntimeError):
                        result.errors += 1
                        history.pop()
                        return
                    history.append({"role": "assistant", "content": text})
                    result.turns.append(Turn(index, turn, ttft, tokens, cached))

            started = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(len(self.histories))))
            result.seconds += time.perf_counter() - started


@contextmanager
def mooncake_env(workdir: Path) -> Iterator[None]:
    """A fresh mooncake_master and $KVFLOW_MOONCAKE_CONFIG pointing at it."""
    master = MooncakeMaster(workdir / f"master-{time.monotonic_ns()}.log")
    config = workdir / f"mooncake-{master.rpc_port}.json"
    config.write_text(
        json.dumps(
            {
                "master_server_address": master.address,
                "metadata_server": master.metadata_url,
                "local_hostname": "127.0.0.1",
                "global_segment_size": 512 * 2**20,
                "local_buffer_size": 64 * 2**20,
            }
        )
    )
    os.environ["KVFLOW_MOONCAKE_CONFIG"] = str(config)
    try:
        yield
    finally:
        os.environ.pop("KVFLOW_MOONCAKE_CONFIG", None)
        master.stop()


def _spec(name: str, flags: list[str]) -> ServerSpec:
    return ServerSpec(name, name, _kvflow_argv(*flags), ("/health",), {}, (), "")


def _configs(args: argparse.Namespace, store_dir: Path) -> dict[str, list[str]]:
    base = ["--max-total-tokens", str(args.device_tokens), "--page-size", PAGE_SIZE]
    l2 = [*base, "--hicache-host-memory-gb", str(args.host_gb)]
    return {
        "off": base,
        "L2": l2,
        "L2 + file": [*l2, "--hicache-storage", "file", "--hicache-storage-path", str(store_dir)],
        "L2 + mooncake": [*l2, "--hicache-storage", "mooncake"],
    }


def run_multiturn(args: argparse.Namespace, workdir: Path) -> list[dict]:
    """All configurations run side by side; turn by turn each gets the same prompts, in a
    rotating order, one at a time (the others idle), so drifts in machine load hit all."""
    opts = LaunchOptions(model_path=str(args.model))
    runs: list[Conversations] = []
    configs = _configs(args, workdir / "multiturn-store")
    with ExitStack() as stack:
        for name, flags in configs.items():
            if "mooncake" in name:
                stack.enter_context(mooncake_env(workdir))
            server = stack.enter_context(
                running_server(_spec(name, flags), opts, workdir / f"{name}.log")
            )
            os.environ.pop("KVFLOW_MOONCAKE_CONFIG", None)  # only that server's
            runs.append(Conversations(server.base_url, args, name))
        for turn in range(args.turns):
            for run in runs[turn % len(runs) :] + runs[: turn % len(runs)]:
                asyncio.run(run.turn(turn))
                print(f"turn {turn + 1} {run.result.name}: done", flush=True)
    rows = [
        {**run.result.summary(), "flags": shlex.join(flags)}
        for run, flags in zip(runs, configs.values(), strict=True)
    ]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


@contextmanager
def _nothing() -> Iterator[None]:
    yield


async def _first_ttft(url: str, messages: list[dict]) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600.0, trust_env=False) as client:
        ttft, *_ = await _chat(client, messages, 4)
        return ttft


def run_warm(args: argparse.Namespace, workdir: Path) -> list[dict]:
    doc = f"You answer questions about canals. {document('canals', args.warm_sentences)}"
    ask = lambda q: [{"role": "system", "content": doc}, {"role": "user", "content": q}]  # noqa: E731
    opts = LaunchOptions(model_path=str(args.model))
    rows = []
    for backend in ("file", "mooncake"):
        store = workdir / f"warm-{backend}"
        flags = [
            "--max-total-tokens", str(max(args.device_tokens, 4096)), "--page-size", PAGE_SIZE,
            "--hicache-host-memory-gb", str(args.host_gb), "--hicache-storage", backend,
            "--hicache-prefetch-timeout", "10",
        ]  # fmt: skip
        env = mooncake_env(workdir) if backend == "mooncake" else _nothing()
        with env:
            store_flags = ["--hicache-storage-path", str(store)] if backend == "file" else []
            # A stays up while B starts: a Mooncake store's pages live in the memory its
            # clients lend (A's segment), so they leave with the last client holding them;
            # the file store keeps them on disk either way.
            with running_server(_spec("A", flags + store_flags), opts, workdir / "A.log") as a:
                asyncio.run(_first_ttft(a.base_url, ask(QUESTIONS[0])))
                _wait_written(a.base_url)
                with running_server(_spec("B", flags + store_flags), opts, workdir / "B.log") as b:
                    warm = asyncio.run(_first_ttft(b.base_url, ask(QUESTIONS[1])))
        cold_env = mooncake_env(workdir) if backend == "mooncake" else _nothing()
        with cold_env:
            cold_flags = (
                ["--hicache-storage-path", str(store) + "-empty"] if backend == "file" else []
            )
            with running_server(_spec("C", flags + cold_flags), opts, workdir / "C.log") as c:
                cold = asyncio.run(_first_ttft(c.base_url, ask(QUESTIONS[1])))
        rows.append({"backend": backend, "warm_ttft_ms": warm * 1e3, "cold_ttft_ms": cold * 1e3,
                     "ratio": warm / cold})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _wait_written(url: str, timeout: float = 60.0) -> None:
    """Until the server's storage writes stop growing (its pages are in the store)."""
    deadline, last = time.monotonic() + timeout, -1.0
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
        written = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kvflow:hicache_storage_bytes_total") and 'op="write"' in line
        )
        if written > 0 and written == last:
            return
        last = written
        time.sleep(1.0)


def render(info: dict, args: argparse.Namespace, multiturn: list[dict], warm: list[dict]) -> str:
    lines = [
        f"Command: `{' '.join(sys.argv)}` (`make bench-hicache`).",
        "Machine: " + ", ".join(f"{k}: {v}" for k, v in info.items()) + ".",
        "",
    ]
    if multiturn:
        lines += _render_multiturn(args, multiturn)
    if warm:
        lines += _render_warm(args, warm)
    return "\n".join(lines) + "\n"


def _render_multiturn(args: argparse.Namespace, multiturn: list[dict]) -> list[str]:
    off = next(r for r in multiturn if r["config"] == "off")
    lines = [
        "## Multi-turn, working set about 4x the device pool",
        "",
        f"{args.conversations} conversations x {args.turns} turns, a ~{args.doc_sentences * 22}-token "
        f"document each, {args.output_len} output tokens per turn, {args.concurrency} at a time; "
        f"device pool {args.device_tokens} tokens, host pool {args.host_gb} GiB, page size "
        f"{PAGE_SIZE}. TTFT over turns >= 2. The four servers run side by side; each turn "
        "goes to each in a rotating order, one server busy at a time.",
        "",
        "| config | TTFT p50 ms | TTFT p90 ms | p50 vs off | output tok/s | cached tokens/request | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in multiturn:
        lines.append(
            f"| {r['config']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
            f"{r['ttft_p50_ms'] / off['ttft_p50_ms']:.2f}x | {r['output_tok_s']:.1f} | "
            f"{r['cached_share']:.0f} | {r['errors']} |"
        )
    return lines


def _render_warm(args: argparse.Namespace, warm: list[dict]) -> list[str]:
    lines = [
        "",
        "## Warm start: a new instance's first request on a long shared document",
        "",
        f"Document ~{args.warm_sentences * 22} tokens. Warm: instance B, started after instance "
        "A answered on it (same store, A still up); cold: instance C on an empty store.",
        "",
        "| store | warm TTFT ms | cold TTFT ms | warm / cold |",
        "|---|---|---|---|",
    ]
    for r in warm:
        lines.append(
            f"| {r['backend']} | {r['warm_ttft_ms']:.0f} | {r['cold_ttft_ms']:.0f} | {r['ratio']:.2f}x |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(EMBEDDED_MODEL))
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--doc-sentences", type=int, default=20)
    parser.add_argument("--warm-sentences", type=int, default=70)
    parser.add_argument("--device-tokens", type=int, default=1024)
    parser.add_argument("--host-gb", type=float, default=0.1)
    parser.add_argument("--parts", default="multiturn,warm")
    parser.add_argument("--out", default="benchmarks/results/hicache.md")
    args = parser.parse_args()
    info = machine_info()
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-hicache-") as tmp:
        workdir = Path(tmp)
        multiturn = run_multiturn(args, workdir) if "multiturn" in parts else []
        warm = run_warm(args, workdir) if "warm" in parts else []
    out = Path(args.out)
    out.write_text(render(info, args, multiturn, warm))
    out.with_suffix(".json").write_text(
        json.dumps({"machine": info, "multiturn": multiturn, "warm": warm}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
