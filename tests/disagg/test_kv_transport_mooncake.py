"""The Mooncake transport between real processes on loopback: KV arrives intact, a dead or
frozen peer is an error within a bound, and layouts that differ are refused."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from kv_helpers import kv_pool, model_config

from kvflow.contract import KV_TRANSFER_PORT_RANGE, POD_IP_ENV
from kvflow.runtime.disagg import (
    KV_TRANSPORTS,
    KVLayout,
    KVTransport,
    TransferError,
    Write,
    layout_of,
    transfer_plan,
)
from kvflow.runtime.mem import KVPool

# NOTE: not importorskip: importing mooncake.engine reads the engine's MC_* settings, which
# the transport sets before its own import.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None,
    reason="mooncake-transfer-engine-non-cuda not installed",
)

PEER = Path(__file__).with_name("kv_peer.py")
TIMEOUT_S = 2.0  # the local transport's write timeout
CONFIG = model_config()


class Peer:
    """``kv_peer.py`` in a subprocess: KV memory registered at ``session_id``."""

    def __init__(self, tmp_path: Path, *args: str, env: dict | None = None) -> None:
        self.tmp_path = tmp_path
        self.log = tmp_path / f"peer-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("wb"),
            bufsize=0,
            env={**os.environ, **(env or {})},
        )
        info = json.loads(self._read_line(timeout=60))
        self.session_id: str = info["session_id"]
        self.layouts = {d: KVLayout.from_dict(raw) for d, raw in info["layouts"].items()}

    def _read_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise AssertionError(f"peer said nothing; its log:\n{self.log.read_text()[-3000:]}")
        return line.decode()

    def dump(self, dtype: str) -> dict[str, list[torch.Tensor]]:
        path = self.tmp_path / f"dump-{dtype}.pt"
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"dump {dtype} {path}\n".encode())
        assert self._read_line(timeout=30).strip() == "ok"
        return torch.load(path)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def pool_peer(tmp_path_factory) -> Iterator[Peer]:
    """Real float32, bfloat16 and FP8 KV pools in another process, advertised at 127.0.0.2 (its
    "pod IP"; any 127/8 address is loopback)."""
    peer = Peer(tmp_path_factory.mktemp("peer"), env={POD_IP_ENV: "127.0.0.2"})
    yield peer
    peer.kill()


@pytest.fixture
def bare_peer(tmp_path: Path) -> Iterator[Peer]:
    """Registered memory in SmolLM2's float32 layout, no torch: quick to start and kill."""
    peer = Peer(tmp_path, "--bare")
    yield peer
    peer.kill()


@pytest.fixture(scope="module")
def local() -> Iterator[tuple[KVTransport, dict[str, KVPool]]]:
    """This process's transport, with a random float32, bfloat16 and FP8 pool registered."""
    transport = KV_TRANSPORTS.get("mooncake")(timeout_s=TIMEOUT_S)
    pools = {}
    for dtype in ("float32", "bfloat16", "float8_e4m3fn"):
        pool = pools[dtype] = kv_pool(CONFIG, 64, getattr(torch, dtype))
        for buf in (*pool.k_buffer, *pool.v_buffer):
            buf.copy_(torch.randn(buf.shape))
        for region in layout_of(pool, CONFIG, 1).regions():
            transport.register(region.ptr, region.nbytes)
    yield transport, pools
    transport.close()


def _port(session_id: str) -> int:
    return int(session_id.rpartition(":")[2])


def _raw(buf: torch.Tensor) -> np.ndarray:
    return buf.view(torch.uint8).numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_write_moves_kv_between_processes(local, pool_peer, dtype: str) -> None:
    transport, pools = local
    low, high = KV_TRANSFER_PORT_RANGE
    assert transport.session_id.startswith("127.0.0.1:")
    assert low <= _port(transport.session_id) <= high
    assert pool_peer.session_id.startswith("127.0.0.2:")
    assert low <= _port(pool_peer.session_id) <= high

    src = layout_of(pools[dtype], CONFIG, 1)
    dst = pool_peer.layouts[dtype]
    src_slots = [*range(5, 25), 40, 41, 33, 60]
    dst_slots = [*range(30, 50), 2, 3, 63, 1]
    transport.write(pool_peer.session_id, transfer_plan(src, dst, src_slots, dst_slots))

    received = pool_peer.dump(dtype)
    untouched = sorted(set(range(64)) - set(dst_slots))
    for kind, buffers in (("k", pools[dtype].k_buffer), ("v", pools[dtype].v_buffer)):
        for layer, src_buf in enumerate(buffers):
            dst_buf = received[kind][layer]
            assert np.array_equal(_raw(dst_buf)[dst_slots], _raw(src_buf)[src_slots])
            assert not _raw(dst_buf)[untouched].any()


def test_layout_mismatch_is_refused_before_any_byte_moves(local, pool_peer) -> None:
    _, pools = local
    src = layout_of(pools["float32"], CONFIG, 1)
    with pytest.raises(ValueError, match=r"dtype differs \(local 'float32', peer 'bfloat16'\)"):
        transfer_plan(src, pool_peer.layouts["bfloat16"], [1, 2], [1, 2])


def test_dead_peer_fails_fast(local, bare_peer) -> None:
    transport, pools = local
    peer = bare_peer
    writes = transfer_plan(
        layout_of(pools["float32"], CONFIG, 1), peer.layouts["float32"], [1], [1]
    )
    transport.write(peer.session_id, writes)
    peer.kill()
    start = time.monotonic()
    with pytest.raises(TransferError, match=peer.session_id):
        transport.write(peer.session_id, writes)
    assert time.monotonic() - start < 3
    with pytest.raises(TransferError):  # nobody ever listened there
        transport.write("127.0.0.1:1", writes)


@pytest.mark.parametrize("handshake_first", [False, True])
def test_frozen_peer_fails_in_bounded_time(local, bare_peer, handshake_first: bool) -> None:
    """A peer that accepts connections but never answers. Before the first handshake the
    engine alone would wait 60 s (then the transport's deadline ends the call); after it,
    the engine's progress timeout (set from the transport's) or the deadline does."""
    transport, pools = local
    peer = bare_peer
    writes = transfer_plan(
        layout_of(pools["float32"], CONFIG, 1), peer.layouts["float32"], [1], [1]
    )
    if handshake_first:
        transport.write(peer.session_id, writes)
    peer.proc.send_signal(signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(TransferError, match=peer.session_id):
        transport.write(peer.session_id, writes)
    assert time.monotonic() - start < TIMEOUT_S + 1.5


def test_malformed_session_is_an_error(local) -> None:
    transport, _ = local
    with pytest.raises(TransferError, match="host:port"):
        transport.write("no-port", [Write(0, 0, 1)])
    transport.write("127.0.0.1:1", [])  # nothing to write: no call at all


def test_concurrent_scattered_writes_to_one_peer_all_land(local, pool_peer) -> None:
    """Writes from several sender threads (a prefill sends chunks and requests at once), each
    of 1,920 pieces (every other slot; last in the file: it fills the peer's float32 pool): together over the engine's per-peer queue, which
    rejects them unless the transport sends one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    transport, pools = local
    src = layout_of(pools["float32"], CONFIG, 1)
    dst = pool_peer.layouts["float32"]
    slots = list(range(0, 64, 2))
    plans = [transfer_plan(src, dst, slots, [s + i % 2 for s in slots]) for i in range(8)]
    assert len(plans[0]) == 2 * CONFIG.num_layers * len(slots)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda plan: transport.write(pool_peer.session_id, plan), plans))
    gc.collect()
    assert len(transport._peer_locks) == 0  # no writer now: the peer's lock is gone
    received = pool_peer.dump("float32")
    for layer, src_buf in enumerate(pools["float32"].k_buffer):
        dst_buf = received["k"][layer]
        assert np.array_equal(_raw(dst_buf)[slots], _raw(src_buf)[slots])
        assert np.array_equal(_raw(dst_buf)[[s + 1 for s in slots]], _raw(src_buf)[slots])


@pytest.fixture
def tight_queue(monkeypatch) -> None:
    """The engine's per-peer TCP queue at 16 pieces, one more waiting at most 1 ms for
    room: any call of more than 17 pieces is rejected as a whole ("queue-full"). The
    engine reads these when a transport starts."""
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "16")
    monkeypatch.setenv("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", "1")
    monkeypatch.setenv("MC_TCP_ADMISSION_TIMEOUT_MS", "1")


def _tight_write(pools, peer: Peer, transport: KVTransport, shift: int) -> list[int]:
    """Write 960 scattered pieces (16 slots x 30 layers x K/V) into the peer's float32
    pool; returns the destination slots."""
    for region in layout_of(pools["float32"], CONFIG, 1).regions():
        transport.register(region.ptr, region.nbytes)
    src_slots = list(range(0, 32, 2))
    dst_slots = [s + shift for s in src_slots]
    plan = transfer_plan(
        layout_of(pools["float32"], CONFIG, 1), peer.layouts["float32"], src_slots, dst_slots
    )
    assert len(plan) == 960
    transport.write(peer.session_id, plan)
    return dst_slots


def _landed(pools, peer: Peer, dst_slots: list[int]) -> None:
    received = peer.dump("float32")
    src_slots = list(range(0, 32, 2))
    for kind, buffers in (("k", pools["float32"].k_buffer), ("v", pools["float32"].v_buffer)):
        for layer, src_buf in enumerate(buffers):
            assert np.array_equal(_raw(received[kind][layer])[dst_slots], _raw(src_buf)[src_slots])


def test_calls_fit_the_engine_queue_the_environment_sets(tight_queue, local, pool_peer) -> None:
    """Admission: the transport sizes its calls to the engine's queue, so a write of 960
    pieces through a 16-piece queue lands with no call rejected."""
    _, pools = local
    with KV_TRANSPORTS.get("mooncake")(timeout_s=TIMEOUT_S) as transport:
        assert transport.max_batch == 16
        dst_slots = _tight_write(pools, pool_peer, transport, shift=1)
        assert transport.retries == 0
    _landed(pools, pool_peer, dst_slots)


def test_rejected_calls_are_repeated_smaller_until_they_land(tight_queue, local, pool_peer) -> None:
    """Retries: calls of 64 and 32 pieces (more than the engine's queue admits, as when an
    abandoned call still fills it) are rejected by Mooncake's real TCP transport, which
    may then fail later calls to that peer too (Mooncake 0.3.13.post1, see the transport's
    module docstring). The transport repeats the call smaller (and through a new engine if
    the peer's lanes stay stuck), and every byte lands within the write's deadline."""
    _, pools = local
    with KV_TRANSPORTS.get("mooncake")(timeout_s=TIMEOUT_S, max_batch=64) as transport:
        start = time.monotonic()
        dst_slots = _tight_write(pools, pool_peer, transport, shift=33)
        assert time.monotonic() - start < TIMEOUT_S
        assert transport.retries >= 2
    _landed(pools, pool_peer, dst_slots)


def test_a_new_engine_writes_with_the_memory_registered_before(local, pool_peer) -> None:
    """What the transport does when a peer's lanes stay stuck: the new engine has every
    region registered and a new session; the stuck one is kept alive, not destroyed."""
    _, pools = local
    with KV_TRANSPORTS.get("mooncake")(timeout_s=TIMEOUT_S) as transport:
        for region in layout_of(pools["float32"], CONFIG, 1).regions():
            transport.register(region.ptr, region.nbytes)
        stuck, first_session = transport._engine, transport.session_id
        assert transport._renew(stuck) is transport._engine is not stuck
        assert transport.session_id != first_session
        assert transport._renew(stuck) is transport._engine  # renewed already: unchanged
        src_slots = list(range(0, 32, 2))
        dst_slots = [s + 1 for s in src_slots]
        plan = transfer_plan(
            layout_of(pools["float32"], CONFIG, 1),
            pool_peer.layouts["float32"],
            src_slots,
            dst_slots,
        )
        transport.write(pool_peer.session_id, plan)
    _landed(pools, pool_peer, dst_slots)


def test_a_dead_peer_is_not_retried(tight_queue, local, bare_peer) -> None:
    """A failed call to a peer whose process is gone (its port refuses) fails at once."""
    _, pools = local
    writes = transfer_plan(
        layout_of(pools["float32"], CONFIG, 1), bare_peer.layouts["float32"], [1], [1]
    )
    with KV_TRANSPORTS.get("mooncake")(timeout_s=TIMEOUT_S) as transport:
        for region in layout_of(pools["float32"], CONFIG, 1).regions():
            transport.register(region.ptr, region.nbytes)
        transport.write(bare_peer.session_id, writes)
        bare_peer.kill()
        start = time.monotonic()
        with pytest.raises(TransferError, match=bare_peer.session_id):
            transport.write(bare_peer.session_id, writes)
        assert time.monotonic() - start < 1.0
        assert transport.retries == 0
