"""The torch attention backend against a naive per-request, per-head softmax attention.

Covers both kinds of parts (requests padded together, and one SDPA call per request), alone
and mixed in one batch, for extend and decode, with GQA, ragged lengths and cached prefixes,
in float32 and bfloat16; and with a sliding window, and soft-capped scores (Gemma 2).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.kernels import cpu as cpu_kernels
from kvflow.runtime.attention import torch_backend
from kvflow.runtime.attention.cpu_backend import CpuKernelBackend
from kvflow.runtime.attention.torch_backend import TorchBackend
from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode
from kvflow.runtime.mem import KVPool, ReqToTokenPool

HEADS, KV_HEADS, DIM = 6, 2, 16
SLOTS = 1024


def naive_attention(q, keys, values, prefix_len, window=None, logit_cap=None):
    """q ``[n, H, D]`` for positions ``prefix_len..``, keys/values ``[ctx, KVH, D]``; a key
    is seen when ``q_pos - k_pos`` is in ``[0, window)`` (transformers' rule)."""
    group = HEADS // KV_HEADS
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q.float(), keys) / math.sqrt(DIM)
    if logit_cap is not None:
        scores = torch.tanh(scores / logit_cap) * logit_cap
    q_pos = torch.arange(q.shape[0])[:, None] + prefix_len
    k_pos = torch.arange(keys.shape[0])[None, :]
    hidden = (k_pos > q_pos) | (q_pos - k_pos >= (window or keys.shape[0] + 1))
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hnk,khd->nhd", scores.softmax(-1), values)


def make_backend(dtype, backend_cls=TorchBackend, window=None, logit_cap=None):
    pool = KVPool(SLOTS, 1, KV_HEADS, DIM, dtype, "cpu")
    rows = ReqToTokenPool(8, 512, "cpu")
    scale = 1 / math.sqrt(DIM)
    backend = backend_cls(pool, rows, HEADS, KV_HEADS, DIM, scale, (window,), logit_cap)
    return backend, pool, rows


def run_batch(backend, rows, prefix_lens, new_lens, dtype, mode):
    """One forward of ``mode`` over fresh requests whose prefixes are already in the pool."""
    gen = torch.Generator().manual_seed(sum(prefix_lens) * 31 + sum(new_lens))
    free = torch.randperm(SLOTS - 1, generator=gen) + 1
    reqs, locs, used = [], [], 0
    for prefix, new in zip(prefix_lens, new_lens, strict=True):
        req = rows.alloc()
        slots = free[used : used + prefix + new]
        used += prefix + new
        rows.write(req, 0, slots)
        reqs.append(req)
        locs.append(slots[prefix:])
        context = torch.randn(prefix, 2, KV_HEADS, DIM, generator=gen).to(dtype)
        backend.kv_pool.k_buffer[0][slots[:prefix]] = context[:, 0]
        backend.kv_pool.v_buffer[0][slots[:prefix]] = context[:, 1]
    total = sum(new_lens)
    context_lens = [p + n for p, n in zip(prefix_lens, new_lens, strict=True)]
    fb = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(total, dtype=torch.int64),
        positions=torch.cat(
            [torch.arange(p, c) for p, c in zip(prefix_lens, context_lens, strict=True)]
        ),
        out_cache_loc=torch.cat(locs),
        req_pool_indices=torch.tensor(reqs),
        seq_lens=torch.tensor(context_lens),
        seq_lens_cpu=context_lens,
        extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens_cpu=list(new_lens),
    )
    q = torch.randn(total, HEADS, DIM, generator=gen).to(dtype)
    k = torch.randn(total, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(total, KV_HEADS, DIM, generator=gen).to(dtype)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, 0, fb)
    expected, start = [], 0
    for req, prefix, new in zip(reqs, prefix_lens, new_lens, strict=True):
        slots = rows.read(req, prefix + new)
        keys, values = backend.kv_pool.k_buffer[0][slots], backend.kv_pool.v_buffer[0][slots]
        window, cap = backend.window(0), backend.logit_cap
        expected.append(naive_attention(q[start : start + new], keys, values, prefix, window, cap))
        start += new
        rows.free(req)
    return out, torch.cat(expected)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
EXTEND_CASES = [([0, 0, 0], [5, 9, 1]), ([0, 7, 3], [4, 2, 6]), ([12], [5]), ([0], [11])]
LONG = torch_backend.SDPA_MIN_NEW_TOKENS


def part_kinds(backend) -> list[str]:
    (parts,) = backend.last_plan.values()  # one plan: the layer's window
    return sorted(type(part).__name__ for part in parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "sdpa"])
@pytest.mark.parametrize(("prefix_lens", "new_lens"), EXTEND_CASES)
def test_extend_matches_naive(monkeypatch, dtype, padded, prefix_lens, new_lens):
    if not padded:
        monkeypatch.setattr(torch_backend, "PADDED_SCORE_BYTES", 0)
    backend, _, rows = make_backend(dtype)
    out, expected = run_batch(backend, rows, prefix_lens, new_lens, dtype, ForwardMode.EXTEND)
    kind = "_PaddedPart" if padded else "_SdpaPart"
    assert part_kinds(backend) == [kind] * (1 if padded else len(new_lens))
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_mixes_sdpa_and_padded_parts(monkeypatch, dtype):
    """A long uncached prompt goes through SDPA; the others are packed within the budget."""
    heads_bytes = 4 * HEADS
    # room for the two short requests (<= 6 new x 40 context) together, not for the third
    monkeypatch.setattr(torch_backend, "PADDED_SCORE_BYTES", 2 * 6 * 40 * heads_bytes)
    backend, _, rows = make_backend(dtype)
    prefix_lens, new_lens = [30, 0, 34, 100], [6, LONG, 4, 20]
    out, expected = run_batch(backend, rows, prefix_lens, new_lens, dtype, ForwardMode.EXTEND)
    assert part_kinds(backend) == ["_PaddedPart", "_SdpaPart", "_SdpaPart"]
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_naive(dtype):
    backend, _, rows = make_backend(dtype)
    out, expected = run_batch(backend, rows, [0, 9, 30, 4], [1, 1, 1, 1], dtype, ForwardMode.DECODE)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


needs_native = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_decodes_with_the_native_kernel(dtype):
    backend, _, rows = make_backend(dtype, CpuKernelBackend)
    lens = [0, 9, 30, 4, 300]
    out, expected = run_batch(backend, rows, lens, [1] * len(lens), dtype, ForwardMode.DECODE)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("prefix_lens", "new_lens"), [*EXTEND_CASES, ([5, 7, 0], [4, 2, LONG])])
def test_cpu_backend_extends_with_the_native_kernel(dtype, prefix_lens, new_lens):
    backend, _, rows = make_backend(dtype, CpuKernelBackend)
    out, expected = run_batch(backend, rows, prefix_lens, new_lens, dtype, ForwardMode.EXTEND)
    assert not hasattr(backend, "last_plan")  # the torch parts were never planned
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


def test_cpu_backend_runs_on_torch_what_its_kernel_cannot(caplog):
    with caplog.at_level("WARNING"):
        backend, _, rows = make_backend(torch.float16, CpuKernelBackend)
    assert not backend.native and "runs on torch" in caplog.text
    out, expected = run_batch(backend, rows, [3, 20], [1, 1], torch.float16, ForwardMode.DECODE)
    assert part_kinds(backend) == ["_PaddedPart"]
    torch.testing.assert_close(out.float(), expected, atol=3e-3, rtol=0)
    out, expected = run_batch(backend, rows, [5, 0], [4, LONG], torch.float16, ForwardMode.EXTEND)
    assert part_kinds(backend) == ["_PaddedPart", "_SdpaPart"]
    torch.testing.assert_close(out.float(), expected, atol=3e-3, rtol=0)


@pytest.fixture(autouse=True)
def _remember_plan(monkeypatch):
    """Record the plan each ``init_forward_metadata`` builds, to check which path ran."""
    original = TorchBackend.init_forward_metadata

    def recording(self, fb):
        original(self, fb)
        self.last_plan = fb.attn_metadata

    monkeypatch.setattr(TorchBackend, "init_forward_metadata", recording)


WINDOW_CASES = [([0, 0, 0], [5, 9, 1]), ([0, 7, 30], [4, 2, 6]), ([40], [5]), ([0], [30])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "sdpa"])
@pytest.mark.parametrize("window", [1, 4, 8])
@pytest.mark.parametrize(("prefix_lens", "new_lens"), WINDOW_CASES)
def test_sliding_window_extend_matches_naive(
    monkeypatch, dtype, padded, window, prefix_lens, new_lens
):
    """Padded parts gather each context from its first new token's window on."""
    if not padded:
        monkeypatch.setattr(torch_backend, "PADDED_SCORE_BYTES", 0)
    backend, _, rows = make_backend(dtype, window=window)
    out, expected = run_batch(backend, rows, prefix_lens, new_lens, dtype, ForwardMode.EXTEND)
    (parts,) = backend.last_plan.values()
    for part in parts:
        if isinstance(part, torch_backend._PaddedPart):
            assert part.max_ctx <= window + part.max_new - 1
        elif part.prefix_slots is not None:
            assert part.prefix_slots.numel() <= window - 1
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window_decode_and_long_prompt(window):
    backend, _, rows = make_backend(torch.float32, window=window)
    lens = [0, 9, 30, 4]
    out, expected = run_batch(backend, rows, lens, [1] * 4, torch.float32, ForwardMode.DECODE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    out, expected = run_batch(backend, rows, [0, 3], [LONG, 7], torch.float32, ForwardMode.EXTEND)
    assert part_kinds(backend) == ["_PaddedPart", "_SdpaPart"]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 4, 8])
def test_cpu_backend_slides_the_window(dtype, window):
    backend, _, rows = make_backend(dtype, CpuKernelBackend, window=window)
    for prefix_lens, new_lens in WINDOW_CASES:
        out, expected = run_batch(backend, rows, prefix_lens, new_lens, dtype, ForwardMode.EXTEND)
        torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)
    lens = [0, 9, 30, 300]
    out, expected = run_batch(backend, rows, lens, [1] * 4, dtype, ForwardMode.DECODE)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


def test_layers_with_different_windows_share_one_plan_each():
    """A full layer and a sliding layer in one batch: one plan per distinct window."""
    pool = KVPool(SLOTS, 3, KV_HEADS, DIM, torch.float32, "cpu")
    rows = ReqToTokenPool(8, 512, "cpu")
    backend = TorchBackend(pool, rows, HEADS, KV_HEADS, DIM, 0.25, (None, 4, 4))
    assert [backend.window(i) for i in range(4)] == [None, 4, 4, None]
    run_batch(backend, rows, [3, 20], [1, 1], torch.float32, ForwardMode.DECODE)
    assert set(backend.last_plan) == {None, 4}


@pytest.mark.parametrize("backend_cls", [TorchBackend, CpuKernelBackend])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "sdpa"])
@pytest.mark.parametrize("window", [None, 4])
def test_softcapped_scores_match_naive(monkeypatch, backend_cls, padded, window):
    """Scores soft-capped at 0.5 in every kind of part (an SDPA part computes them itself:
    SDPA cannot cap), in extend (cached prefixes, a long uncached prompt) and decode."""
    if backend_cls is CpuKernelBackend and not cpu_kernels.available():
        pytest.skip("no C compiler for the native kernels")
    if not padded:
        monkeypatch.setattr(torch_backend, "PADDED_SCORE_BYTES", 0)
    backend, _, rows = make_backend(torch.float32, backend_cls, window, logit_cap=0.5)
    for prefix_lens, new_lens, mode in (
        ([0, 7, 3], [4, 2, 6], ForwardMode.EXTEND),
        ([0], [LONG + 3], ForwardMode.EXTEND),
        ([5, 30], [1, 1], ForwardMode.DECODE),
    ):
        out, expected = run_batch(backend, rows, prefix_lens, new_lens, torch.float32, mode)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    backend.logit_cap = None  # the same batch (same seed) uncapped: the cap matters
    _, uncapped = run_batch(backend, rows, [5, 30], [1, 1], torch.float32, ForwardMode.DECODE)
    assert (uncapped - expected).abs().max() > 0.01
