"""The same-host KV transport (cuda_ipc) between two processes: every byte of a contiguous
and a scattered plan lands where the plan says, as byte ranges and as slot runs (one
kernel), on one GPU and (with two GPUs) from one GPU into another's memory; pieces outside
the decode's advertised buffers and a decode that advertises more than it owns are refused.

Skipped without CUDA; run on the accelerator machine with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PD = Path(__file__).resolve().parents[2] / "benchmarks" / "pd"
sys.path.insert(0, str(PD))
SLOTS, LAYERS, SEED = 1024, 4, 11


def _start_peer(**env: str) -> Iterator[tuple[subprocess.Popen, dict]]:
    """A decode-side pool (Llama-8B's KV heads, 4 layers) in another process."""
    proc = subprocess.Popen(
        [sys.executable, "-P", str(PD / "gpu_kv_peer.py"), "--num-slots", str(SLOTS),
         "--layers", str(LAYERS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": f"{PD}:{os.environ.get('PYTHONPATH', '')}", **env},
    )  # fmt: skip
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    assert ready, "the peer did not start"
    info = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
    yield proc, info
    proc.kill()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def peer() -> Iterator[tuple[subprocess.Popen, dict]]:
    """The decode on this process's GPU."""
    yield from _start_peer()


@pytest.fixture(scope="module")
def other_gpu_peer() -> Iterator[tuple[subprocess.Popen, dict]]:
    """The decode on the second GPU (the writer keeps the first): a two-GPU machine only."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (CUDA)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    second = visible.split(",")[1] if visible else "1"
    yield from _start_peer(CUDA_VISIBLE_DEVICES=second)


def test_a_decode_advertising_more_than_it_owns_is_refused(peer) -> None:
    """The sizes a decode states are checked against the allocation the handle maps (first
    in the file: the writer fixture maps the same allocations for the other tests)."""
    from kvflow.runtime.disagg import KV_TRANSPORTS, TransferError, Write

    info = json.loads(json.dumps(peer[1]["peer_info"]))
    info["buffers"][0]["nbytes"] = info["buffers"][0]["storage_bytes"] = 1 << 40
    transport = KV_TRANSPORTS.get("cuda_ipc")()
    try:
        transport.add_peer("forged", info)
        with pytest.raises(TransferError, match="advertised"):
            transport.write("forged", [Write(0, info["buffers"][0]["addr"], 8)])
    finally:
        transport.close()


@pytest.fixture(scope="module")
def writer(peer):
    from gpu_kv_peer import filled_pool, model_config

    from kvflow.runtime.disagg import KV_TRANSPORTS, layout_of

    config = model_config(LAYERS)
    pool = filled_pool(config, SLOTS, SEED)
    transport = KV_TRANSPORTS.get("cuda_ipc")()
    layout = layout_of(pool, config, page_size=1)
    for buffer in (*pool.k_buffer, *pool.v_buffer):
        transport.register_buffer(buffer)
    transport.add_peer(peer[1]["session_id"], peer[1]["peer_info"])
    yield transport, layout
    transport.close()


def _check(proc: subprocess.Popen, src: list[int], dst: list[int]) -> str:
    proc.stdin.write(f"check {SEED} {','.join(map(str, src))} {','.join(map(str, dst))}\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    return proc.stdout.readline().strip()  # type: ignore[union-attr]


@pytest.mark.parametrize("shape", ["contiguous", "pages", "scattered"])
def test_every_byte_lands_where_the_plan_says(peer, writer, shape) -> None:
    from kvflow.runtime.disagg import KVLayout, transfer_plan

    transport, layout = writer
    proc, info = peer
    src = list(range(1, 257))
    rng = random.Random(shape)
    if shape == "contiguous":
        dst = list(range(500, 756))
    elif shape == "pages":
        dst = [p * 16 + i for p in rng.sample(range(1, SLOTS // 16), 16) for i in range(16)]
    else:
        dst = rng.sample(range(1, SLOTS), 256)
    plan = transfer_plan(layout, KVLayout.from_dict(info["layout"]), src, dst)
    transport.write(info["session_id"], plan)
    assert _check(proc, src, dst) == "ok"


def test_pieces_outside_the_decode_buffers_are_refused(peer, writer) -> None:
    from kvflow.runtime.disagg import TransferError, Write

    transport, layout = writer
    info = peer[1]
    end = info["layout"]["k_addrs"][0] + SLOTS * layout.slot_bytes
    with pytest.raises(TransferError, match="outside every destination buffer"):
        transport.write(info["session_id"], [Write(layout.k_addrs[0], end - 8, 64)])


def _slots(shape: str, offset: int) -> tuple[list[int], list[int]]:
    """Source slots (after ``offset``: bytes no other test wrote) and their destinations."""
    src = list(range(offset, offset + 256))
    rng = random.Random(shape)
    if shape == "contiguous":
        return src, list(range(500, 756))
    if shape == "pages":
        return src, [p * 16 + i for p in rng.sample(range(1, SLOTS // 16), 16) for i in range(16)]
    return src, rng.sample(range(1, SLOTS), 256)


@pytest.mark.parametrize("shape", ["contiguous", "pages", "scattered"])
def test_a_slot_plan_lands_where_it_says_in_one_kernel(peer, writer, shape) -> None:
    from kvflow.runtime.disagg import KVLayout, slot_plan

    transport, layout = writer
    proc, info = peer
    src, dst = _slots(shape, 300)
    plan = slot_plan(layout, KVLayout.from_dict(info["layout"]), src, dst)
    transport.write_plan(info["session_id"], plan)
    assert _check(proc, src, dst) == "ok"


@pytest.mark.parametrize("shape", ["contiguous", "pages"])
def test_kv_reaches_another_gpus_memory(other_gpu_peer, writer, shape) -> None:
    """The writer on GPU 0 maps the decode's buffers on GPU 1: the slot-run kernel writes
    them over NVLink (mapped into GPU 0's address space), byte ranges likewise."""
    from kvflow.runtime.disagg import KVLayout, slot_plan

    transport, layout = writer
    proc, info = other_gpu_peer
    transport.add_peer(info["session_id"], info["peer_info"])
    dst_layout = KVLayout.from_dict(info["layout"])
    src, dst = _slots(shape, 600)
    transport.write_plan(info["session_id"], slot_plan(layout, dst_layout, src, dst))
    assert _check(proc, src, dst) == "ok"
    src = [s + 1 for s in src]  # other bytes at the same place, as byte ranges
    transport.write(info["session_id"], slot_plan(layout, dst_layout, src, dst).writes())
    assert _check(proc, src, dst) == "ok"
