"""A decode's registration under tensor parallelism: every rank's endpoint travels in one
``/register``; the prefill checks each against its own rank's layout and refuses another
``--tp-size`` (so does the decode with the prefill's answer); one rank keeps the old wire
format."""

from __future__ import annotations

import http.client
import json

import pytest
import torch
from fake_bootstrap import FakeBootstrap, reports
from kv_helpers import model_config

from kvflow.runtime.disagg import layout_of
from kvflow.runtime.disagg.bootstrap import BootstrapServer
from kvflow.runtime.disagg.bootstrap_client import BootstrapClient, BootstrapError
from kvflow.runtime.disagg.ranks import Endpoint
from kvflow.runtime.disagg.rooms import Rooms
from kvflow.runtime.mem import KVPool

PEER = {"transport": "mooncake", "protocol": "tcp"}
# 2 KV heads: one per rank at --tp-size 2
CONFIG = model_config(num_attention_heads=8, num_key_value_heads=2)


def _layout(kv_heads: int, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    pool = KVPool(8, CONFIG.num_layers, kv_heads, CONFIG.head_dim, dtype, "cpu")
    return layout_of(pool, CONFIG, page_size=1, kv_heads=kv_heads)


def _prefill(tp_size: int) -> BootstrapServer:
    layouts = [_layout(CONFIG.num_kv_heads // tp_size) for _ in range(tp_size)]
    rank_layouts = layouts if tp_size > 1 else ()
    server = BootstrapServer("127.0.0.1", 0, layouts[0], Rooms(5), rank_layouts=rank_layouts)
    server.start()
    return server


def _decode(tp_size: int) -> list[Endpoint]:
    heads = CONFIG.num_kv_heads // tp_size
    return [Endpoint(f"127.0.0.1:{1000 + r}", _layout(heads), PEER) for r in range(tp_size)]


def _register(address: str, ranks: list[Endpoint]) -> None:
    first = ranks[0]
    BootstrapClient(address).register(first.session, first.layout, first.peer, ranks[1:])


def test_a_rank_holds_its_share_of_the_kv_heads() -> None:
    shard = _layout(1)
    assert shard.num_kv_heads == 1 and "kv_heads=2" in shard.model  # the model's own count
    assert shard.slot_bytes * 2 == _layout(2).slot_bytes
    pool = KVPool(8, CONFIG.num_layers, 1, CONFIG.head_dim, torch.float32, "cpu")
    with pytest.raises(ValueError, match="does not fit"):
        layout_of(pool, CONFIG, page_size=1)  # not all of the model's heads


def test_a_decode_registers_every_rank_with_a_prefill_of_its_size() -> None:
    server = _prefill(2)
    try:
        ranks = _decode(2)
        _register(f"127.0.0.1:{server.port}", ranks)
        assert server.sessions == {ranks[0].session: tuple(ranks)}
    finally:
        server.stop()


@pytest.mark.parametrize(("prefill", "decode"), [(2, 1), (1, 2)])
def test_another_tp_size_is_refused_at_registration(prefill, decode) -> None:
    server = _prefill(prefill)
    try:
        with pytest.raises(BootstrapError) as refused:
            _register(f"127.0.0.1:{server.port}", _decode(decode))
        assert refused.value.refused and not server.sessions
        sizes = f"prefill --tp-size {prefill}, decode --tp-size {decode}"
        assert f"refused by the prefill: tensor-parallel size differs ({sizes})" in str(
            refused.value
        )
    finally:
        server.stop()


def test_a_prefill_that_names_no_size_is_one_rank() -> None:
    """A prefill that predates tensor parallelism (answers no tp_size) takes any
    registration: the decode of two ranks refuses it; one rank sends what it always did."""
    with FakeBootstrap(reports({})) as fake:
        with pytest.raises(BootstrapError, match=r"prefill --tp-size 1, decode --tp-size 2"):
            _register(fake.address, _decode(2))
        assert set(fake.calls[-1][1]) == {"session", "layout", "peer", "tp_size", "ranks"}
        _register(fake.address, _decode(1))
        assert set(fake.calls[-1][1]) == {"session", "layout", "peer"}


def test_a_rank_whose_layout_differs_is_named() -> None:
    server = _prefill(2)
    try:
        ranks = _decode(2)
        ranks[1] = ranks[1]._replace(layout=_layout(1, torch.bfloat16))
        with pytest.raises(BootstrapError, match="tensor-parallel rank 1: KV layout mismatch"):
            _register(f"127.0.0.1:{server.port}", ranks)
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"tp_size": 2}, "needs 1 more ranks"),
        ({"tp_size": True, "ranks": []}, "tp_size must be an integer"),
        ({"tp_size": 2, "ranks": ["x"]}, "a rank's endpoint must be an object"),
    ],
)
def test_malformed_registrations_are_a_400(extra, why) -> None:
    server = _prefill(2)
    try:
        body = {**_decode(1)[0].to_dict(), **extra}
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        conn.request("POST", "/register", body=json.dumps(body))
        response = conn.getresponse()
        assert response.status == 400
        assert why in json.loads(response.read())["error"]
        conn.close()
    finally:
        server.stop()
