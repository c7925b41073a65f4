"""KVLayout: built from a real KV pool, JSON round trip, and mismatch messages."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from kv_helpers import kv_pool, model_config

from kvflow.runtime.disagg import KVLayout, layout_of, model_fingerprint


def test_layout_of_describes_the_pool() -> None:
    config = model_config()
    pool = kv_pool(config, num_slots=17, dtype=torch.bfloat16)
    layout = layout_of(pool, config, page_size=1)
    assert layout.model == model_fingerprint(config)
    assert "LlamaForCausalLM" in layout.model and "vocab=49152" in layout.model
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (30, 3, 64)
    assert layout.dtype == "bfloat16"
    assert layout.slot_bytes == 3 * 64 * 2
    assert layout.num_slots == 17
    assert layout.k_addrs == tuple(t.data_ptr() for t in pool.k_buffer)
    assert layout.v_addrs == tuple(t.data_ptr() for t in pool.v_buffer)
    regions = layout.regions()
    assert len(regions) == 60
    assert all(r.nbytes == pool.k_buffer[0].nbytes for r in regions)


def test_layout_of_refuses_a_pool_of_another_shape() -> None:
    pool = kv_pool(model_config(num_key_value_heads=1), num_slots=4)
    with pytest.raises(ValueError, match="does not fit"):
        layout_of(pool, model_config(), page_size=1)
    with pytest.raises(ValueError, match="layers"):
        layout_of(pool, model_config(num_hidden_layers=2, num_key_value_heads=1), page_size=1)


def test_dict_round_trip_is_json_safe() -> None:
    config = model_config()
    layout = layout_of(kv_pool(config, num_slots=5), config, page_size=1)
    assert KVLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    raw = layout.to_dict()
    raw["extra"] = 1
    with pytest.raises(ValueError, match="extra"):
        KVLayout.from_dict(raw)
    del raw["extra"], raw["dtype"]
    with pytest.raises(ValueError, match="dtype"):
        KVLayout.from_dict(raw)


def test_addresses_and_pool_size_may_differ() -> None:
    config = model_config()
    local = layout_of(kv_pool(config, num_slots=5), config, page_size=1)
    peer = layout_of(kv_pool(config, num_slots=9), config, page_size=1)
    assert local.k_addrs != peer.k_addrs
    assert local.mismatch(peer) is None


@pytest.mark.parametrize(
    ("peer_overrides", "peer_dtype", "peer_page", "label"),
    [
        ({"num_hidden_layers": 2}, torch.float32, 1, "layers"),
        ({"num_key_value_heads": 1}, torch.float32, 1, "kv heads"),
        ({"head_dim": 32}, torch.float32, 1, "head_dim"),
        ({}, torch.bfloat16, 1, "dtype"),
        ({}, torch.float32, 16, "page size"),
        ({"vocab_size": 32000}, torch.float32, 1, "model"),
        ({"architectures": ["Qwen2ForCausalLM"]}, torch.float32, 1, "model"),
    ],
)
def test_mismatch_names_the_field(peer_overrides, peer_dtype, peer_page, label) -> None:
    config, peer_config = model_config(), model_config(**peer_overrides)
    local = layout_of(kv_pool(config, num_slots=3), config, page_size=1)
    peer = layout_of(kv_pool(peer_config, 3, peer_dtype), peer_config, page_size=peer_page)
    message = local.mismatch(peer)
    assert message is not None and f"mismatch: {label} differs" in message


def test_layout_checks_its_own_consistency() -> None:
    config = model_config()
    layout = layout_of(kv_pool(config, num_slots=3), config, page_size=1)
    with pytest.raises(ValueError, match="addresses"):
        dataclasses.replace(layout, k_addrs=layout.k_addrs[:-1])
    with pytest.raises(ValueError, match="positive"):
        dataclasses.replace(layout, num_slots=0)
