"""KV transfer throughput between two processes: the Mooncake transport over loopback TCP.

The sender (this process) and a receiver (this script with ``--receiver``) each hold a KV
pool in the embedded model's shape (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64) and
register it with a ``MooncakeTransport``. For each dtype and transfer size the sender
writes the same slots over and over for ``--seconds`` and reports sustained GB/s (KV bytes
moved / wall time of the ``write`` calls; the plan is built once, its cost reported apart).
``contiguous`` rows move slots 1..N to slots 1..N (one write per layer and K/V);
``pages of 16`` rows scatter the destination in shuffled 16-slot pages, as a fragmented
decode pool would. Writes results/kv-transfer.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

from kvflow.runtime.config import ModelConfig
from kvflow.runtime.disagg import KV_TRANSPORTS, KVLayout, layout_of, transfer_plan
from kvflow.runtime.mem import KVPool
from kvflow.runtime.models import embedded_model_path

RESULTS = Path(__file__).parent / "results" / "kv-transfer.md"
PAGE = 16


def make_pool(config: ModelConfig, dtype: str, num_slots: int) -> KVPool:
    dtype_t = getattr(torch, dtype)
    return KVPool(
        num_slots, config.num_layers, config.num_kv_heads, config.head_dim, dtype_t, "cpu"
    )


def receiver(dtype: str, num_slots: int) -> None:
    """Hold a registered pool until stdin closes."""
    config = ModelConfig.from_path(embedded_model_path())
    pool = make_pool(config, dtype, num_slots)
    layout = layout_of(pool, config, page_size=1)
    transport = KV_TRANSPORTS.get("mooncake")()
    for region in layout.regions():
        transport.register(region.ptr, region.nbytes)
    print(json.dumps({"session_id": transport.session_id, "layout": layout.to_dict()}), flush=True)
    sys.stdin.read()
    transport.close()


def measure(transport, session_id, writes, seconds: float) -> tuple[float, float, int]:
    """(GB/s, median ms per transfer, transfers) over at least ``seconds`` and 3 transfers."""
    nbytes = sum(w.nbytes for w in writes)
    transport.write(session_id, writes)  # warm: connection and handshake
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        transport.write(session_id, writes)
        times.append(time.perf_counter() - t0)
    return nbytes * len(times) / sum(times) / 1e9, statistics.median(times) * 1e3, len(times)


class RawEngine:
    """The transport's Mooncake engine called directly, in calls of the transport's batch
    size, without kvflow's call thread, deadline or retries: the raw figure beside
    kvflow's."""

    def __init__(self, transport) -> None:
        self.engine, self.batch = transport._engine, transport.max_batch

    def write(self, session_id: str, writes) -> None:
        for start in range(0, len(writes), self.batch):
            part = writes[start : start + self.batch]
            status = self.engine.batch_transfer_sync_write(
                session_id, [w.src_ptr for w in part], [w.dst_ptr for w in part],
                [w.nbytes for w in part],
            )  # fmt: skip
            if status != 0:
                raise RuntimeError(f"raw engine write failed (status {status})")


def scattered_pages(n: int, num_slots: int, rng: random.Random) -> list[int]:
    pages = list(range(1, num_slots // PAGE))  # page 0 holds the padding slot
    rng.shuffle(pages)
    return [page * PAGE + i for page in pages[: (n + PAGE - 1) // PAGE] for i in range(PAGE)][:n]


def run(args: argparse.Namespace) -> list[dict]:
    config = ModelConfig.from_path(embedded_model_path())
    transport = KV_TRANSPORTS.get("mooncake")()
    rng = random.Random(0)
    rows = []
    pools = []  # registered memory must outlive the transport
    num_slots = max(args.tokens) * 2 + PAGE
    for dtype in args.dtypes:
        pool = make_pool(config, dtype, num_slots)
        pools.append(pool)
        for buf in (*pool.k_buffer, *pool.v_buffer):
            buf.normal_()
        src = layout_of(pool, config, page_size=1)
        for region in src.regions():
            transport.register(region.ptr, region.nbytes)
        peer = subprocess.Popen(
            [sys.executable, __file__, "--receiver", dtype, str(num_slots)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            info = json.loads(peer.stdout.readline())  # type: ignore[union-attr]
            dst = KVLayout.from_dict(info["layout"])
            for n in args.tokens:
                slots = list(range(1, n + 1))
                for pattern, dst_slots in (
                    ("contiguous", slots),
                    (f"pages of {PAGE}", scattered_pages(n, num_slots, rng)),
                ):
                    t0 = time.perf_counter()
                    writes = transfer_plan(src, dst, slots, dst_slots)
                    plan_ms = (time.perf_counter() - t0) * 1e3
                    gbps, ms, count = measure(transport, info["session_id"], writes, args.seconds)
                    raw = measure(RawEngine(transport), info["session_id"], writes, args.seconds)
                    row = {
                        "dtype": dtype,
                        "tokens": n,
                        "pattern": pattern,
                        "writes": len(writes),
                        "mib": sum(w.nbytes for w in writes) / 2**20,
                        "plan_ms": plan_ms,
                        "ms": ms,
                        "gbps": gbps,
                        "raw_gbps": raw[0],
                        "transfers": count,
                    }
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        finally:
            peer.stdin.close()  # type: ignore[union-attr]
            peer.wait(timeout=30)
    transport.close()
    return rows


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return (
        f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}, "
        f"mooncake-transfer-engine-non-cuda {version('mooncake-transfer-engine-non-cuda')}"
    )


def report(rows: list[dict], command: str, load_before: tuple, load_after: tuple) -> str:
    lines = [
        "# KV transfer: Mooncake transport, two processes, loopback TCP",
        "",
        "Written by `benchmarks/bench_kv_transfer.py` (`make bench-kv-transfer`).",
        "",
        f"- command: `{command}`",
        f"- machine: {machine()}",
        f"- load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; "
        f"after: {', '.join(f'{x:.2f}' for x in load_after)}",
        "- KV shape: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), page size 1; "
        "bytes are K and V of every layer",
        "- GB/s = bytes moved / wall time of `write` (plan built once, its time apart); "
        "each size repeated for the stated seconds after one warm-up write; raw GB/s: the "
        "same plan through the Mooncake engine directly (no call thread, deadline or retries)",
        "",
        "| dtype | tokens | destination | writes | MiB | plan ms | ms / transfer | GB/s | raw GB/s |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['tokens']} | {r['pattern']} | {r['writes']} | "
            f"{r['mib']:.1f} | {r['plan_ms']:.2f} | {r['ms']:.2f} | {r['gbps']:.2f} | "
            f"{r['raw_gbps']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="128,1024,4096", help="tokens per transfer")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--seconds", type=float, default=3.0, help="per row")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--receiver", nargs=2, metavar=("DTYPE", "SLOTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        receiver(args.receiver[0], int(args.receiver[1]))
        return
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.dtypes = args.dtypes.split(",")
    command = " ".join(["python", "benchmarks/bench_kv_transfer.py", *sys.argv[1:]])
    load_before = os.getloadavg()
    rows = run(args)
    text = report(rows, command, load_before, os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
