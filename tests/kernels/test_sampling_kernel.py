"""top_k_top_p_sampling_from_probs against the sort-based torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import device_for

from kvflow.kernels import top_k_top_p_sampling_from_probs, top_k_top_p_sampling_ref
from kvflow.kernels.sampling import kept_mask_ref


def _check(device, batch, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    temperature = torch.rand(batch, 1, generator=gen) * 4 + 0.25
    probs = torch.softmax(torch.randn(batch, vocab, generator=gen) * temperature, dim=-1)
    probs[0] = 1.0 / vocab  # all tied: top-k keeps every tie
    probs[1, : vocab // 2] = 0.0  # zeros are never drawn
    top_k = torch.randint(-1, vocab + 2, (batch,), generator=gen, dtype=torch.int32)
    top_k[2] = 1  # greedy
    top_p = torch.rand(batch, generator=gen).clamp(min=0.05)
    top_p[3] = 1.0
    uniform = torch.rand(batch, generator=gen)
    expected = top_k_top_p_sampling_ref(probs, top_k, top_p, uniform)
    got = top_k_top_p_sampling_from_probs(
        *(t.to(device) for t in (probs, top_k, top_p, uniform))
    ).cpu()
    assert got.dtype == torch.int64 and got.shape == (batch,)
    assert got[2] == probs[2].argmax()
    assert probs[1, got[1]] > 0
    for row in (got != expected).nonzero().flatten().tolist():
        # Only a draw that lands within rounding of a bucket edge may differ (sum order).
        keep = kept_mask_ref(probs[row], int(top_k[row]), float(top_p[row]))
        assert keep[got[row]], f"row {row}: drew filtered-out token {got[row]}"
        kept = torch.where(keep, probs[row], 0.0)
        edge = kept.cumsum(0)[min(got[row], expected[row])]
        target = uniform[row] * kept.sum()
        assert abs(float(edge - target)) < 1e-5, f"row {row}: {got[row]} != {expected[row]}"


@pytest.mark.interpret
@pytest.mark.parametrize(("batch", "vocab", "seed"), [(6, 700, 0)])
def test_sampling_interpret(batch, vocab, seed):
    _check(device_for("interpret"), batch, vocab, seed)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("batch", "vocab", "seed"), [(64, 128256, 0), (8, 49152, 1), (33, 4099, 2)]
)
def test_sampling_gpu(batch, vocab, seed):
    _check(device_for("gpu"), batch, vocab, seed)


def test_sampling_ref_respects_filters():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    one = torch.ones(1)
    # top-k 2 keeps {0.4, 0.3}: u=0 -> index 1, u just below 1 -> index 3.
    k2 = torch.tensor([2], dtype=torch.int32)
    assert top_k_top_p_sampling_ref(probs, k2, one, torch.zeros(1)).item() == 1
    assert top_k_top_p_sampling_ref(probs, k2, one, torch.full((1,), 0.999)).item() == 3
    # top-p 0.6 keeps 0.4 + 0.3 (the shortest sorted prefix reaching 0.6 of the mass).
    no_k = torch.zeros(1, dtype=torch.int32)
    draws = {
        top_k_top_p_sampling_ref(probs, no_k, torch.full((1,), 0.6), torch.full((1,), u)).item()
        for u in (0.0, 0.3, 0.56, 0.58, 0.9)
    }
    assert draws == {1, 3}
