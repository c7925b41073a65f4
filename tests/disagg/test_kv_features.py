"""An EAGLE target's features in the KV layout: described, compared with the peer's (a
decode whose head reads features refuses a prefill that keeps none, or another head's),
moved slot for slot with the KV by the plan, and left out of the dict of a layout without
them (a peer that predates them reads it as before)."""

from __future__ import annotations

import ctypes
import json
from typing import NamedTuple

import pytest
import torch
from kv_helpers import kv_pool, model_config

from kvflow.runtime.disagg import FeatureBuffer, KVLayout, layout_of, slot_plan
from kvflow.runtime.mem import KVPool
from kvflow.runtime.models import FeatureSpec

CONFIG = model_config(num_hidden_layers=2)
HIDDEN = 64
EAGLE = FeatureSpec(HIDDEN, ()).label("float32")
EAGLE3 = FeatureSpec(3 * HIDDEN, (1, 2, 3)).label("float32")


def _pool(num_slots: int, kind: str | None = EAGLE, width: int = HIDDEN) -> _Pool:
    """A KV pool of random KV and, with ``kind``, random feature rows."""
    pool = kv_pool(CONFIG, num_slots)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.copy_(torch.randn(buf.shape))
    rows = torch.randn(num_slots, width)
    features = None if kind is None else FeatureBuffer(kind, rows)
    return _Pool(layout_of(pool, CONFIG, 1, features=features), pool, rows)


class _Pool(NamedTuple):
    layout: KVLayout
    kv: KVPool  # (the buffers behind the layout's addresses, kept alive)
    features: torch.Tensor


def _layout(num_slots: int, kind: str | None = EAGLE, width: int = HIDDEN) -> KVLayout:
    return _pool(num_slots, kind, width).layout


def test_features_are_described_and_registered() -> None:
    layout = _layout(5)
    assert layout.features == "final-norm hidden state x64 float32"
    assert layout.feature_bytes == HIDDEN * 4
    assert layout.regions()[-1].nbytes == 5 * HIDDEN * 4
    assert len(layout.regions()) == 2 * CONFIG.num_layers + 1
    assert KVLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    assert EAGLE3 == "inputs of layers 1,2,3 x192 float32"


def test_a_layout_without_features_keeps_its_old_dict() -> None:
    plain = _layout(5, kind=None)
    raw = plain.to_dict()
    assert not {"features", "feature_bytes", "feature_addr"} & set(raw)
    assert KVLayout.from_dict(raw) == plain
    with pytest.raises(ValueError, match="positive feature_bytes"):
        KVLayout.from_dict({**raw, "features": EAGLE})


@pytest.mark.parametrize(
    ("peer_kind", "peer_width", "shown"),
    [
        (None, HIDDEN, "peer 'none'"),  # a prefill started without the EAGLE flags
        (EAGLE3, 3 * HIDDEN, "peer 'inputs of layers 1,2,3 x192 float32'"),  # another head
        (FeatureSpec(HIDDEN, ()).label("bfloat16"), HIDDEN, "bfloat16"),
    ],
)
def test_peers_must_keep_the_same_features(peer_kind, peer_width, shown) -> None:
    decode = _layout(4)
    prefill = _layout(6, peer_kind, peer_width)
    message = decode.mismatch(prefill)
    assert message is not None
    assert "EAGLE features per slot differs (local 'final-norm hidden state x64 float32'" in message
    assert shown in message and "--speculative-algorithm (EAGLE, EAGLE3)" in message
    assert prefill.mismatch(decode) is not None  # refused by either side
    with pytest.raises(ValueError, match="EAGLE features"):
        slot_plan(prefill, decode, [1], [1])


def test_the_plan_moves_each_slots_features_with_its_kv() -> None:
    src, dst = _pool(12), _pool(20)
    before = dst.features.clone()
    src_slots, dst_slots = [3, 4, 5, 9], [10, 11, 2, 19]
    plan = slot_plan(src.layout, dst.layout, src_slots, dst_slots)
    for write in plan.writes():
        ctypes.memmove(write.dst_ptr, write.src_ptr, write.nbytes)
    assert len(plan.feature_writes()) == 3  # runs: 3-4 -> 10-11, 5 -> 2, 9 -> 19
    assert plan.nbytes == 4 * (2 * CONFIG.num_layers * src.layout.slot_bytes + HIDDEN * 4)
    assert torch.equal(dst.features[dst_slots], src.features[src_slots])
    untouched = sorted(set(range(20)) - set(dst_slots))
    assert torch.equal(dst.features[untouched], before[untouched])
    assert torch.equal(dst.kv.k_buffer[1][dst_slots], src.kv.k_buffer[1][src_slots])


def test_a_prefill_without_features_refuses_an_eagle_decode_on_the_wire() -> None:
    """What a decode started with EAGLE hears from a prefill started without the flags:
    its registration is refused with the reason (its requests fail with it, a 503)."""
    from kvflow.runtime.disagg.bootstrap import BootstrapServer
    from kvflow.runtime.disagg.bootstrap_client import BootstrapClient, BootstrapError
    from kvflow.runtime.disagg.rooms import Rooms

    prefill, decode = _pool(8, kind=None), _pool(8)
    server = BootstrapServer("127.0.0.1", 0, prefill.layout, Rooms(timeout_s=5))
    server.start()
    try:
        with pytest.raises(BootstrapError) as refused:
            BootstrapClient(f"127.0.0.1:{server.port}").register("127.0.0.1:1", decode.layout)
    finally:
        server.stop()
    assert refused.value.refused
    assert (
        "refused by the prefill: KV layout mismatch: EAGLE features per slot differs "
        "(local 'none', peer 'final-norm hidden state x64 float32'): start prefill and decode "
        "with the same --speculative-algorithm (EAGLE, EAGLE3)"
    ) in str(refused.value)
