"""gemv (one-token projections) against torch's fp32 product."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import device_for

from kvflow.kernels import gemv, gemv_ref


def _check(device, dtype, k, n, config=None):
    gen = torch.Generator().manual_seed(k * 7 + n)
    x = torch.randn(1, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    expected = gemv_ref(x.double(), weight.double()).float()
    kwargs = {"config": config} if config else {}
    got = gemv(x.to(device), weight.to(device), **kwargs)
    assert got.shape == (1, n) and got.dtype == dtype
    # One rounding of an fp32 sum to the output dtype (the interpreter truncates bf16).
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.cpu().float(), expected, atol=tol, rtol=tol)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("k", "n"), [(300, 37), (64, 5)])
def test_gemv_interpret(dtype, k, n):
    _check(device_for("interpret"), dtype, k, n, config=(4, 128, 4, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("k", "n"), [(4096, 6144), (14336, 4096), (4096, 128256), (1000, 37), (576, 1536)]
)
def test_gemv_gpu(dtype, k, n):
    _check(device_for("gpu"), dtype, k, n)


def test_gemv_rejects_batches():
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(torch.zeros(2, 8), torch.zeros(4, 8))
