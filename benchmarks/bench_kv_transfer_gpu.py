"""KV transfer between two processes on one GPU host: kvflow's cuda_ipc transport against
Mooncake's nvlink_intra and TCP, on Llama-3.1-8B's KV shape (bf16, 128 KiB per token).

For each transport a writer process (the prefill's side) fills a pool from a seed, and a
peer process (``benchmarks/pd/gpu_kv_peer.py``, the decode's side) registers its pool; the
writer moves a 4,000-token prompt's KV (524 MB) into the peer, contiguous and as 16-slot
pages scattered over the peer's pool (what a decode's allocator hands out), times each
write (median of ``--iters`` after one warm-up) and has the peer check every byte once.
Each writer and peer is its own process (Mooncake's MC_INTRANODE_NVLINK is process-wide).
cuda_ipc is timed twice per shape: the prefill's call (``write_plan``: the plan's slot
runs, one kernel for all layers) and byte-range writes (``write``: a ``Write`` per run per
buffer, what Mooncake takes; its row is ``... (byte ranges)``). With ``--peer-gpu 1`` the
peer runs on the second GPU (the writer keeps the first): the transfer crosses NVLink.

    python benchmarks/bench_kv_transfer_gpu.py --out results.json [--peer-gpu 1]
    python benchmarks/bench_kv_transfer_gpu.py --writer --backend cuda_ipc   # one row
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER = HERE / "pd" / "gpu_kv_peer.py"
TRANSPORTS = [("cuda_ipc", "tcp"), ("mooncake", "nvlink_intra"), ("mooncake", "tcp")]
TOKENS = 4000
PAGE = 16
NUM_SLOTS = 8192
SEED = 7


def _peer(backend: str, protocol: str, gpu: int | None) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "PYTHONPATH": f"{HERE / 'pd'}:{os.environ.get('PYTHONPATH', '')}"}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    proc = subprocess.Popen(
        [sys.executable, "-P", str(PEER), "--backend", backend, "--protocol", protocol,
         "--num-slots", str(NUM_SLOTS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""  # type: ignore[union-attr]
    if not line:
        proc.kill()
        raise RuntimeError(f"the {backend}/{protocol} peer did not start")
    return proc, json.loads(line)


def _check(proc: subprocess.Popen, src: list[int], dst: list[int]) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"check {SEED} {','.join(map(str, src))} {','.join(map(str, dst))}\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def writer(backend: str, protocol: str, iters: int, peer_gpu: int | None) -> dict:
    """One transport's row (runs in its own process)."""
    sys.path.insert(0, str(HERE / "pd"))
    import torch
    from gpu_kv_peer import filled_pool, model_config

    from kvflow.runtime.disagg import KVLayout, layout_of, slot_plan
    from kvflow.runtime.disagg.transport import KVTransferOptions

    peer, info = _peer(backend, protocol, peer_gpu)
    row: dict = {"backend": backend, "protocol": protocol, "peer_gpu": peer_gpu}
    try:
        config = model_config()
        pool = filled_pool(config, NUM_SLOTS, SEED)
        options = KVTransferOptions(backend=backend, protocol=protocol, timeout_s=30)
        options.require_env()
        transport = options.transport()
        src = layout_of(pool, config, page_size=1)
        for buffer in (*pool.k_buffer, *pool.v_buffer):
            transport.register_buffer(buffer)
        transport.add_peer(info["session_id"], info["peer_info"])
        dst = KVLayout.from_dict(info["layout"])
        src_slots = list(range(1, TOKENS + 1))
        pages = random.Random(0).sample(range(1, NUM_SLOTS // PAGE), TOKENS // PAGE)
        shapes = {
            "contiguous": list(range(2000, 2000 + TOKENS)),
            "pages of 16": [p * PAGE + i for p in pages for i in range(PAGE)],
        }
        calls = {"": transport.write_plan}
        if backend == "cuda_ipc":
            calls[" (byte ranges)"] = lambda session, plan: transport.write(session, plan.writes())
        for (name, dst_slots), (label, call) in itertools.product(shapes.items(), calls.items()):
            plan = slot_plan(src, dst, src_slots, dst_slots)
            times = []
            for _ in range(iters + 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                call(info["session_id"], plan)
                times.append(time.perf_counter() - start)
            median = statistics.median(times[1:])
            nbytes = plan.nbytes
            row[name + label] = {
                "pieces": len(plan.writes()),
                "runs": int(plan.counts.size),
                "bytes": nbytes,
                "first_ms": round(times[0] * 1e3, 2),
                "median_ms": round(median * 1e3, 2),
                "gb_s": round(nbytes / median / 1e9, 1),
                "check": _check(peer, src_slots, dst_slots),
            }
        transport.close()
    except Exception as exc:  # the error is this row's result
        row["error"] = repr(exc)[:2000]
    finally:
        peer.kill()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writer", action="store_true", help="run one transport's row")
    parser.add_argument("--backend", default="cuda_ipc")
    parser.add_argument("--protocol", default="tcp")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSON of every row")
    parser.add_argument("--peer-gpu", type=int, default=None, help="the peer's GPU index")
    args = parser.parse_args()
    if args.writer:
        row = writer(args.backend, args.protocol, args.iters, args.peer_gpu)
        print(json.dumps(row), flush=True)
        return
    gpu = [] if args.peer_gpu is None else ["--peer-gpu", str(args.peer_gpu)]
    rows = []
    for backend, protocol in TRANSPORTS:
        done = subprocess.run(
            [sys.executable, "-P", __file__, "--writer", "--backend", backend,
             "--protocol", protocol, "--iters", str(args.iters), *gpu],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if lines else {
            "backend": backend, "protocol": protocol, "error": done.stderr[-2000:]
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
