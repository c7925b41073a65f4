"""The fused mixture-of-experts kernel against a token-by-token reference, and the pair
alignment it runs on (sorted by expert, padded per expert, no host sync). FP8 weights with
per-row or block scales against the same reference on the dequantized weights. Both paths:
the grouped GEMMs and the small-batch one (a matrix-vector product per pair, no sort)."""

from __future__ import annotations

import importlib

import pytest
import torch
from kernel_testing import device_for

from kvflow.kernels import (
    FP8_DTYPE,
    MOE_SMALL_BATCH_MAX_PAIRS,
    ExpertScales,
    fused_moe,
    fused_moe_ref,
    moe_align_block_size,
)

TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}
PATHS = {"small": True, "grouped": False}  # fused_moe's small_batch


def _inputs(tokens, experts, top_k, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return x, w13, w2, weights, ids


def _check(device, tokens, experts, top_k, hidden, inter, dtype, small_batch=None):
    x, w13, w2, weights, ids = _inputs(tokens, experts, top_k, hidden, inter, dtype)
    expected = fused_moe_ref(x.double(), w13.double(), w2.double(), weights, ids).float()
    on = [t.to(device) for t in (x, w13, w2, weights, ids)]
    got = fused_moe(*on, small_batch=small_batch)
    assert got.shape == x.shape and got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu().float(), expected, atol=tol, rtol=tol)


def _fp8_experts(w: torch.Tensor, block: tuple[int, int] | None):
    """``w`` ``[E, N, K]`` -> FP8 weight, its scales and the float weight they stand for
    (per row: absmax / 448; per block of ``block``: each block's absmax / 448)."""
    experts, n, k = w.shape
    if block is None:
        scale = w.abs().amax(-1).clamp(min=1e-12) / 448
        full = scale[..., None].expand(-1, -1, k)
    else:
        bn, bk = block
        pad = torch.zeros(experts, -(-n // bn) * bn, -(-k // bk) * bk)
        pad[:, :n, :k] = w
        tiles = pad.view(experts, pad.shape[1] // bn, bn, pad.shape[2] // bk, bk)
        scale = tiles.abs().amax((2, 4)).clamp(min=1e-12) / 448
        full = scale.repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :n, :k]
    q = (w / full).clamp(-448, 448).to(FP8_DTYPE)
    return q, ExpertScales(scale.float().contiguous(), block), q.float() * full


def _check_fp8(
    device, tokens, experts, top_k, hidden, inter, dtype, w13_block, w2_block, small_batch=None
):
    x, w13, w2, weights, ids = _inputs(tokens, experts, top_k, hidden, inter, torch.float32)
    x = x.to(dtype)
    q13, s13, d13 = _fp8_experts(w13, w13_block)
    q2, s2, d2 = _fp8_experts(w2, w2_block)
    expected = fused_moe_ref(x.double(), d13.double(), d2.double(), weights, ids).float()
    on = [t.to(device) for t in (x, q13, q2, weights, ids)]
    scales = [ExpertScales(s.scale.to(device), s.block_size) for s in (s13, s2)]
    got = fused_moe(*on, *scales, small_batch=small_batch)
    assert got.shape == x.shape and got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu().float(), expected, atol=tol, rtol=tol)


def test_alignment_sorts_pairs_by_expert_in_padded_runs():
    ids = torch.tensor([[3, 0], [0, 1], [3, 1], [2, 0]])  # a token's top-k ids are distinct
    block = 4
    aligned = moe_align_block_size(ids, block, num_experts=5)
    flat = ids.flatten().tolist()
    used = int(aligned.num_padded)
    # runs: expert 0 (3 pairs) -> 4, 1 (2) -> 4, 2 (1) -> 4, 3 (2) -> 4, 4 (0) -> 0
    assert used == 16
    blocks = aligned.sorted_ids[:used].view(-1, block).tolist()
    assert aligned.expert_ids[: used // block].tolist() == [0, 1, 2, 3]
    for expert, row in zip(aligned.expert_ids.tolist(), blocks, strict=False):
        pairs = [p for p in row if p < len(flat)]
        assert all(flat[p] == expert for p in pairs)
        assert pairs == sorted(pairs)  # token order within an expert
    real = sorted(p for p in aligned.sorted_ids.tolist() if p < len(flat))
    assert real == list(range(len(flat)))  # every pair exactly once


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_fused_moe_interpret(dtype, tokens):
    _check(device_for("interpret"), tokens, experts=8, top_k=2, hidden=64, inter=48, dtype=dtype)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "top_k", "hidden", "inter"),
    [(1, 2, 64, 48), (2, 2, 64, 48), (7, 2, 64, 48), (2, 3, 60, 40)],
)
def test_small_batch_path_interpret(dtype, tokens, top_k, hidden, inter):
    """The no-sort path, forced; top_k 3 pads the down kernel's pair axis to 4, and 60 x 40
    leaves partial blocks of rows and of columns in both launches."""
    device = device_for("interpret")
    _check(device, tokens, 8, top_k, hidden, inter, dtype, small_batch=True)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_batch_path_with_experts_repeated_across_tokens_interpret(dtype):
    """Tokens sharing experts (and one routing repeated): both paths equal the reference."""
    x, w13, w2, weights, _ = _inputs(5, 6, 3, 64, 40, dtype)
    ids = torch.tensor([[4, 1, 2], [1, 4, 0], [2, 1, 4], [4, 1, 2], [1, 5, 4]])
    expected = fused_moe_ref(x.double(), w13.double(), w2.double(), weights, ids).float()
    small = fused_moe(x, w13, w2, weights, ids, small_batch=True).float()
    grouped = fused_moe(x, w13, w2, weights, ids, small_batch=False).float()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(small, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(small, grouped, atol=tol, rtol=tol)


@pytest.mark.interpret
def test_small_batch_path_is_chosen_by_the_number_of_pairs_interpret(monkeypatch):
    module = importlib.import_module("kvflow.kernels.fused_moe")
    calls = []
    small_batch = module.fused_moe_small_batch
    monkeypatch.setattr(
        module, "fused_moe_small_batch", lambda *args: calls.append(1) or small_batch(*args)
    )
    top_k = 2
    for tokens in (1, MOE_SMALL_BATCH_MAX_PAIRS // top_k, MOE_SMALL_BATCH_MAX_PAIRS // top_k + 1):
        fused_moe(*_inputs(tokens, 4, top_k, 32, 16, torch.float32))
    assert len(calls) == 2


# (w13 blocks, w2 blocks): per-row scales; 128x128 blocks over whole and partial blocks
# (w2's 96 input columns end inside one); block scales expanded to rows (bn 1), as the
# FP8 experts method does where gate and up end inside a block
FP8_SCALES = {
    "per-row": (None, None),
    "block-128": ((128, 128), (128, 128)),
    "block-rows": ((1, 128), (128, 128)),
}


@pytest.mark.interpret
@pytest.mark.parametrize("scales", list(FP8_SCALES))
@pytest.mark.parametrize("tokens", [1, 9])
def test_fused_moe_fp8_interpret(scales, tokens):
    """W8A16 through the interpreter: FP8 weights, float32 activations (its dot is fp32);
    the grouped path (the small one, slow to interpret at 18 pairs, is tested below)."""
    block13, block2 = FP8_SCALES[scales]
    _check_fp8(
        device_for("interpret"), tokens, 4, 2, 256, 96, torch.float32, block13, block2, False
    )


@pytest.mark.interpret
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("scales", list(FP8_SCALES))
def test_fused_moe_fp8_paths_interpret(scales, path):
    """Both paths on FP8 weights at 3 tokens (top_k 3: the small path pads it to 4)."""
    device, block13, block2 = device_for("interpret"), *FP8_SCALES[scales]
    _check_fp8(device, 3, 4, 3, 256, 96, torch.float32, block13, block2, PATHS[path])


def test_fp8_scales_of_the_wrong_shape_are_refused():
    x, w13, w2, weights, ids = _inputs(3, 4, 2, 64, 32, torch.float32)
    q13, s13, _ = _fp8_experts(w13, (128, 128))
    q2, s2, _ = _fp8_experts(w2, None)
    with pytest.raises(ValueError, match="w13: scales"):
        fused_moe(x, q13, q2, weights, ids, ExpertScales(s13.scale[:, :, :0], (128, 128)), s2)
    with pytest.raises(ValueError, match="w2: an FP8 weight needs its scales"):
        fused_moe(x, q13, q2, weights, ids, s13, None)


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("scales", list(FP8_SCALES))
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"),
    [(1, 128, 8, 2048, 768), (37, 128, 8, 2048, 768), (5, 8, 2, 256, 96)],
    ids=["qwen3-30b-a3b-b1", "qwen3-30b-a3b-b37", "tiny"],
)
def test_fused_moe_fp8_gpu(scales, tokens, experts, top_k, hidden, inter, path):
    _check_fp8(
        device_for("gpu"), tokens, experts, top_k, hidden, inter, torch.bfloat16,
        *FP8_SCALES[scales], PATHS[path],
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
def test_fused_moe_fp8_in_a_cuda_graph(path):
    """FP8 block-scaled experts captured once and replayed with another routing."""
    x, w13, w2, weights, ids = _inputs(8, 16, 4, 256, 128, torch.float32)
    q13, s13, d13 = _fp8_experts(w13, (128, 128))
    q2, s2, d2 = _fp8_experts(w2, (128, 128))
    x, q13, q2, weights, ids = (t.cuda() for t in (x.bfloat16(), q13, q2, weights, ids))
    s13, s2 = (ExpertScales(s.scale.cuda(), s.block_size) for s in (s13, s2))
    small = PATHS[path]
    fused_moe(x, q13, q2, weights, ids, s13, s2, small_batch=small)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, q13, q2, weights, ids, s13, s2, small_batch=small)
    _, _, _, weights2, ids2 = _inputs(8, 16, 4, 256, 128, torch.float32, seed=5)
    weights.copy_(weights2.cuda())
    ids.copy_(ids2.cuda())
    graph.replay()
    expected = fused_moe_ref(x.double(), d13.cuda().double(), d2.cuda().double(), weights, ids)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"),
    [(1, 128, 8, 2048, 768), (37, 128, 8, 2048, 768), (300, 8, 2, 1024, 1792), (4, 8, 2, 64, 48)],
    ids=["qwen3-30b-a3b-b1", "qwen3-30b-a3b-b37", "mixtral-like-300", "tiny"],
)
def test_fused_moe_gpu(dtype, tokens, experts, top_k, hidden, inter, path):
    _check(device_for("gpu"), tokens, experts, top_k, hidden, inter, dtype, PATHS[path])


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
def test_fused_moe_in_a_cuda_graph(path):
    """Captured once, replayed with another routing: the replay follows the new routing."""
    x, w13, w2, weights, ids = (t.cuda() for t in _inputs(8, 16, 4, 128, 64, torch.bfloat16))
    small = PATHS[path]
    fused_moe(x, w13, w2, weights, ids, small_batch=small)  # warm (compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids, small_batch=small)
    _, _, _, weights2, ids2 = _inputs(8, 16, 4, 128, 64, torch.bfloat16, seed=5)
    weights.copy_(weights2.cuda())
    ids.copy_(ids2.cuda())
    graph.replay()
    expected = fused_moe_ref(x.double(), w13.double(), w2.double(), weights, ids).float()
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
