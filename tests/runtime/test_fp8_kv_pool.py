"""The FP8 KV pool (``--kv-cache-dtype fp8_e4m3 | fp8_e5m2``): what it stores and reads
back, its size, and how a checkpoint's KV scales are resolved per layer."""

from __future__ import annotations

import pytest
import torch

from kvflow.runtime.layers.quantization import (
    KVScaleReader,
    KVScales,
    check_kv_cache_device,
    kv_cache_torch_dtype,
)
from kvflow.runtime.mem import KVPool

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = KVScales(k=(0.37, 2.0), v=(1.0, 0.011))


def _pool(dtype: torch.dtype, scales: KVScales | None = SCALES) -> KVPool:
    return KVPool(32, 2, 2, 8, dtype, "cpu", scales)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_store_rounds_x_over_scale_and_read_multiplies_back(dtype):
    pool = _pool(dtype)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(5, 2, 8, generator=gen) * 3
    v = torch.randn(5, 2, 8, generator=gen)
    k[0, 0, 0], v[1, 1, 1] = 1e6, -1e6  # beyond the format: saturated, not inf/NaN
    loc = torch.tensor([3, 9, 4, 30, 17])
    pool.store(1, loc, k, v)
    limit = torch.finfo(dtype).max
    want_k = (k / 2.0).clamp(-limit, limit).to(dtype)
    want_v = (v / 0.011).clamp(-limit, limit).to(dtype)
    assert torch.equal(pool.k_buffer[1][loc].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(pool.v_buffer[1][loc].view(torch.uint8), want_v.view(torch.uint8))
    read_k, read_v = pool.read(1, loc, torch.float32)
    assert torch.equal(read_k, want_k.float() * 2.0)
    assert torch.equal(read_v, want_v.float() * 0.011)
    assert read_k.isfinite().all() and read_k[0, 0, 0] == limit * 2.0
    # round trip: within the format's relative step (3 or 2 mantissa bits) of the input
    step = 2.0**-3 if dtype == torch.float8_e4m3fn else 2.0**-2
    inside = k.abs() < limit
    assert ((read_k - k).abs() <= step * k.abs() + 1e-3)[inside].all()
    assert not pool.k_buffer[0].view(torch.uint8).any()  # other layers untouched
    pool.zero_slots(loc)
    assert not pool.k_buffer[1].view(torch.uint8).any()
    assert not pool.v_buffer[1].view(torch.uint8).any()


def test_bytes_per_token_follow_the_storage_dtype():
    bf16 = KVPool.bytes_per_token(4, 2, 64, torch.bfloat16)
    for dtype in FP8_DTYPES:
        assert KVPool.bytes_per_token(4, 2, 64, dtype) * 2 == bf16
        assert _pool(dtype).k_buffer[0].element_size() == 1


def test_scales_apply_to_fp8_pools_only():
    assert _pool(torch.float8_e4m3fn).k_scales == SCALES.k
    assert _pool(torch.float8_e4m3fn, None).v_scales == (1.0, 1.0)
    assert _pool(torch.bfloat16).k_scales == (1.0, 1.0)
    with pytest.raises(ValueError, match="layers"):
        KVPool(4, 3, 1, 8, torch.float8_e5m2, "cpu", SCALES)


def test_flag_values_map_to_storage_dtypes():
    assert kv_cache_torch_dtype("auto", torch.float32) == torch.float32
    assert kv_cache_torch_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert kv_cache_torch_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert kv_cache_torch_dtype("bf16", torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="kv-cache-dtype mxfp8"):
        kv_cache_torch_dtype("mxfp8", torch.bfloat16)


def test_checkpoint_scales_follow_sglangs_rule():
    """k and v both given: each; only one (or AutoFP8's kv_scale): it for both; none: 1.0.
    ModelOpt names them under k_proj / v_proj."""
    reader = KVScaleReader(4)
    taken = [
        reader.take("layers.0.self_attn.k_scale", torch.tensor(0.5)),
        reader.take("layers.0.self_attn.v_scale", torch.tensor([0.25])),
        reader.take("layers.1.self_attn.kv_scale", torch.tensor(2.0)),
        reader.take("layers.2.self_attn.k_proj.k_scale", torch.tensor(3.0)),
        reader.take("layers.0.self_attn.k_proj.weight", torch.zeros(2, 2)),
        reader.take("layers.0.mlp.down_proj.input_scale", torch.tensor(1.0)),
    ]
    assert taken == [True, True, True, True, False, False]
    assert reader.scales() == KVScales(k=(0.5, 2.0, 3.0, 1.0), v=(0.25, 2.0, 3.0, 1.0))


def test_per_head_scales_are_refused():
    with pytest.raises(ValueError, match="one scale per layer"):
        KVScaleReader(1).take("layers.0.self_attn.k_scale", torch.ones(4))


def test_fp8_e4m3_is_refused_on_gpus_before_ada(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8\.9 or newer"):
        check_kv_cache_device("fp8_e4m3", "cuda")
    check_kv_cache_device("fp8_e5m2", "cuda")
    check_kv_cache_device("fp8_e4m3", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_kv_cache_device("fp8_e4m3", "cuda:0")
