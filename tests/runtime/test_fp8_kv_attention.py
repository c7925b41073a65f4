"""The torch and cpu attention backends over an FP8 KV pool against naive float32 attention
over the keys and values as the pool holds them (rounded to FP8 with the layer's scales,
times the scales, rounded here in plain torch), the new tokens' included: extend with
cached prefixes (padded parts and SDPA parts, a long uncached prompt) and decode."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.kernels import cpu as cpu_kernels
from kvflow.runtime.attention import torch_backend
from kvflow.runtime.attention.cpu_backend import CpuKernelBackend
from kvflow.runtime.attention.torch_backend import TorchBackend
from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode
from kvflow.runtime.layers.quantization import KVScales
from kvflow.runtime.mem import KVPool, ReqToTokenPool

HEADS, KV_HEADS, DIM, SLOTS = 4, 2, 16, 1024
LAYER = 1  # the second layer: its own scales
SCALES = KVScales(k=(1.0, 0.37), v=(1.0, 1.9))
LONG = torch_backend.SDPA_MIN_NEW_TOKENS
CASES = [
    ([0, 7, 3], [4, 2, 6], ForwardMode.EXTEND),
    ([0, 40], [LONG + 3, 5], ForwardMode.EXTEND),
    ([5, 30, 1], [1, 1, 1], ForwardMode.DECODE),
]


def _rounded(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype).float() * scale


def _naive(q, keys, values, prefix_len):
    group = HEADS // KV_HEADS
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,khd->hnk", q.float(), keys) / math.sqrt(DIM)
    q_pos = torch.arange(q.shape[0])[:, None] + prefix_len
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hnk,khd->nhd", scores.softmax(-1), values)


def _run(backend, rows, kv_dtype, model_dtype, prefix_lens, new_lens, mode):
    """Prefixes stored through the pool, then one forward; returns (out, expected)."""
    gen = torch.Generator().manual_seed(sum(prefix_lens) + 7 * sum(new_lens))
    pool, free = backend.kv_pool, torch.randperm(SLOTS - 1, generator=gen) + 1
    reqs, locs, full_k, full_v, used = [], [], [], [], 0
    for prefix, new in zip(prefix_lens, new_lens, strict=True):
        req, slots = rows.alloc(), free[used : used + prefix + new]
        used += prefix + new
        rows.write(req, 0, slots)
        k = torch.randn(prefix + new, KV_HEADS, DIM, generator=gen).to(model_dtype)
        v = torch.randn(prefix + new, KV_HEADS, DIM, generator=gen).to(model_dtype)
        pool.store(LAYER, slots[:prefix], k[:prefix], v[:prefix])
        reqs.append(req)
        locs.append(slots[prefix:])
        full_k.append(k)
        full_v.append(v)
    context = [p + n for p, n in zip(prefix_lens, new_lens, strict=True)]
    fb = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(sum(new_lens), dtype=torch.int64),
        positions=torch.cat(
            [torch.arange(p, c) for p, c in zip(prefix_lens, context, strict=True)]
        ),
        out_cache_loc=torch.cat(locs),
        req_pool_indices=torch.tensor(reqs),
        seq_lens=torch.tensor(context),
        seq_lens_cpu=context,
        extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens_cpu=list(new_lens),
    )
    q = torch.randn(sum(new_lens), HEADS, DIM, generator=gen).to(model_dtype)
    new_k = torch.cat([k[p:] for k, p in zip(full_k, prefix_lens, strict=True)])
    new_v = torch.cat([v[p:] for v, p in zip(full_v, prefix_lens, strict=True)])
    backend.init_forward_metadata(fb)
    out = backend.forward(q, new_k, new_v, LAYER, fb)
    expected, start = [], 0
    for k, v, prefix, new in zip(full_k, full_v, prefix_lens, new_lens, strict=True):
        keys = _rounded(k, SCALES.k[LAYER], kv_dtype)
        values = _rounded(v, SCALES.v[LAYER], kv_dtype)
        expected.append(_naive(q[start : start + new], keys, values, prefix))
        start += new
    for req in reqs:
        rows.free(req)
    return out, torch.cat(expected)


# (backend, SDPA parts): the cpu backend's kernel has padded-like rows only
BACKENDS = [(TorchBackend, False), (TorchBackend, True), (CpuKernelBackend, False)]


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize(("backend_cls", "sdpa"), BACKENDS, ids=["torch", "torch-sdpa", "cpu"])
def test_fp8_pool_attention_equals_dequantized_reference(
    monkeypatch, backend_cls, sdpa, kv_dtype, model_dtype
):
    if backend_cls is CpuKernelBackend and not cpu_kernels.available():
        pytest.skip("no C compiler for the native kernels")
    if sdpa:  # every request its own SDPA part
        monkeypatch.setattr(torch_backend, "PADDED_SCORE_BYTES", 0)
    pool = KVPool(SLOTS, 2, KV_HEADS, DIM, kv_dtype, "cpu", SCALES)
    rows = ReqToTokenPool(8, 512, "cpu")
    backend = backend_cls(
        pool, rows, HEADS, KV_HEADS, DIM, 1 / math.sqrt(DIM), model_dtype=model_dtype
    )
    assert backend.reads_stored_kv
    if backend_cls is CpuKernelBackend:
        assert backend.native  # the kernel itself reads FP8
    # float32: the same numbers up to float32 rounding; bfloat16 rounds q, K * scale, P
    tolerance = 2e-5 if model_dtype == torch.float32 else 4e-2
    for prefix_lens, new_lens, mode in CASES:
        out, expected = _run(backend, rows, kv_dtype, model_dtype, prefix_lens, new_lens, mode)
        torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=0)
