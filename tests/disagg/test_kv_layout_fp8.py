"""PD with an FP8 KV cache: a slot moves half the bytes of bfloat16, and a prefill and a
decode whose KV dtypes differ refuse each other at registration, each side naming the
flag (the real bootstrap endpoint refusing the decode; the decode refusing a prefill that
answers with another layout)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fake_bootstrap import FakeBootstrap
from kv_helpers import kv_pool, model_config

from kvflow.runtime.disagg import layout_of
from kvflow.runtime.disagg.bootstrap import BootstrapServer
from kvflow.runtime.disagg.bootstrap_client import BootstrapClient, BootstrapError
from kvflow.runtime.disagg.rooms import Rooms


def _layout(dtype: torch.dtype):
    config = model_config()
    return layout_of(kv_pool(config, num_slots=8, dtype=dtype), config, page_size=1)


def test_fp8_slots_move_half_the_bytes() -> None:
    bf16, fp8 = _layout(torch.bfloat16), _layout(torch.float8_e4m3fn)
    assert fp8.dtype == "float8_e4m3fn"
    assert fp8.slot_bytes * 2 == bf16.slot_bytes == 3 * 64 * 2
    assert sum(r.nbytes for r in fp8.regions()) * 2 == sum(r.nbytes for r in bf16.regions())
    message = fp8.mismatch(_layout(torch.float8_e5m2))
    assert message is not None and "dtype differs" in message and "--kv-cache-dtype" in message


def test_the_prefill_refuses_a_decode_of_another_kv_dtype() -> None:
    server = BootstrapServer("127.0.0.1", 0, _layout(torch.bfloat16), Rooms(timeout_s=5))
    server.start()
    try:
        client = BootstrapClient(f"127.0.0.1:{server.port}")
        with pytest.raises(BootstrapError, match=r"dtype differs.*--kv-cache-dtype") as err:
            client.register("127.0.0.1:1", _layout(torch.float8_e4m3fn))
        assert err.value.refused and "float8_e4m3fn" in str(err.value)
        client.register("127.0.0.1:1", _layout(torch.bfloat16))  # the same dtype: accepted
    finally:
        server.stop()


def test_the_decode_refuses_a_prefill_answering_another_kv_dtype() -> None:
    theirs = dataclasses.replace(_layout(torch.float8_e4m3fn), dtype="bfloat16")

    def answer(path, body):
        return 200, {"layout": theirs.to_dict()}

    with FakeBootstrap(answer) as fake:
        client = BootstrapClient(fake.address)
        with pytest.raises(BootstrapError, match=r"refused the prefill.*dtype differs") as err:
            client.register("127.0.0.1:1", _layout(torch.float8_e4m3fn))
        assert err.value.refused


def test_the_decode_refuses_an_answer_without_a_layout() -> None:
    with (
        FakeBootstrap(lambda path, body: (200, {})) as fake,
        pytest.raises(BootstrapError, match="no KV layout"),
    ):
        BootstrapClient(fake.address).register("s", _layout(torch.float8_e4m3fn))
