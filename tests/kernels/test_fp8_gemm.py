"""FP8 activation quantization and GEMMs against their torch references (interpreted on
CPU and compiled on CUDA; ``torch._scaled_mm`` on CUDA only)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import device_for

from kvflow.kernels import (
    FP8_DTYPE,
    fp8_gemv,
    fp8_gemv_ref,
    fp8_rowwise_mm,
    fp8_rowwise_mm_ref,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
    w8a8_block_fp8_matmul,
    w8a8_block_fp8_matmul_ref,
)


def _check_group_quant(device: str, rows: int, cols: int, group: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(rows * cols + group)
    x = (torch.randn(rows, cols, generator=gen) * 3).to(dtype)
    x[0, :group] = 0  # an all-zero group gets a tiny scale, not a division by zero
    q, scales = per_token_group_quant_fp8(x.to(device), group)
    q_ref, scales_ref = per_token_group_quant_fp8_ref(x, group)
    assert q.dtype == FP8_DTYPE and scales.shape == (rows, cols // group)
    torch.testing.assert_close(scales.cpu(), scales_ref, rtol=1e-6, atol=0)
    got, expected = q.cpu().float(), q_ref.float()
    wrong = got != expected
    if device == "cpu":
        # NOTE: Triton 3.x's interpreter drops the carry when rounding up reaches the next
        # power of two (128 becomes 64) and flushes subnormals; CUDA rounds as torch does.
        carry = (got * 2 == expected) & (expected.abs().log2() % 1 == 0)
        flushed = (got == 0) & (expected.abs() <= 2**-6)
        assert (carry | flushed)[wrong].all()
    else:
        # x / scale in fp32 may land on the other side of a rounding boundary than the
        # reference's: such values are one e4m3 step (2^-3 of the value) away, and rare.
        step = expected.abs().clamp_min(2**-9) * 2**-3
        assert ((got - expected).abs() <= step)[wrong].all()
        assert wrong.float().mean() < 1e-2
    deq = expected * scales_ref.repeat_interleave(group, 1)
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, small ones within the
    # subnormal step
    bound = x.float().abs() * 2**-4 + scales_ref.repeat_interleave(group, 1) * 2**-9
    assert ((deq - x.float()).abs() <= bound).all()


def _check_block_matmul(device, rows, n, k, block, out_dtype):
    gen = torch.Generator().manual_seed(rows + n + k)
    xq = torch.randn(rows, k, generator=gen).to(FP8_DTYPE)
    w = torch.randn(n, k, generator=gen).to(FP8_DTYPE)
    x_scale = torch.rand(rows, -(-k // block[1]), generator=gen) + 0.5
    w_scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 1e-2
    args = (x_scale, w, w_scale, block, out_dtype)
    got = w8a8_block_fp8_matmul(xq.to(device), *(a.to(device) for a in args[:3]), *args[3:])
    expected = w8a8_block_fp8_matmul_ref(xq, *args).float()
    # NOTE: Hopper's FP8 tensor cores accumulate with about 14 mantissa bits (the DeepSeek-V3
    # report), not fp32's 23: float32 outputs are compared at 2e-3 of the largest value.
    tol = 1.6e-2 if out_dtype == torch.bfloat16 else (1e-4 if device == "cpu" else 2e-3)
    scale = expected.abs().max()
    torch.testing.assert_close(got.cpu().float(), expected, atol=tol * scale, rtol=tol)


@pytest.mark.interpret
@pytest.mark.parametrize(("rows", "cols", "group"), [(3, 256, 128), (2, 96, 96)])
def test_group_quant_interpret(rows, cols, group):
    _check_group_quant(device_for("interpret"), rows, cols, group, torch.float32)


@pytest.mark.interpret
@pytest.mark.parametrize(("rows", "n", "k"), [(3, 256, 256), (5, 192, 320)])
def test_block_matmul_interpret(rows, n, k):
    _check_block_matmul(device_for("interpret"), rows, n, k, (128, 128), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rows", "cols", "group"), [(1, 4096, 128), (37, 4096, 4096), (300, 1536, 128)]
)
def test_group_quant_gpu(rows, cols, group, dtype):
    _check_group_quant(device_for("gpu"), rows, cols, group, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 4096, 4096), (33, 1536, 4096), (300, 384, 640)])
def test_block_matmul_gpu(rows, n, k, out_dtype):
    _check_block_matmul(device_for("gpu"), rows, n, k, (128, 128), out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_rowwise_scaled_mm_gpu(rows):
    gen = torch.Generator().manual_seed(rows)
    xq = torch.randn(rows, 512, generator=gen).to(FP8_DTYPE)
    w = torch.randn(384, 512, generator=gen).to(FP8_DTYPE)
    x_scale = torch.rand(rows, 1, generator=gen) + 0.5
    w_scale = torch.rand(1, 384, generator=gen) * 1e-2
    got = fp8_rowwise_mm(xq.cuda(), x_scale.cuda(), w.cuda(), w_scale.cuda(), torch.float16)
    expected = fp8_rowwise_mm_ref(xq, x_scale, w, w_scale, torch.float32)
    assert got.dtype == torch.float16
    torch.testing.assert_close(
        got.cpu().float(), expected, atol=2e-2 * expected.abs().max(), rtol=2e-2
    )


def _check_gemv(device: str, n: int, k: int, blocked: bool, dtype: torch.dtype, config=None):
    gen = torch.Generator().manual_seed(n * 3 + k)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(FP8_DTYPE)
    scales: dict = {}
    if blocked:
        block = torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 1e-2 + 1e-3
        scales = {"block_scale": block, "block_size": (128, 128)}
    else:
        scales = {"row_scale": torch.rand(n, generator=gen) * 1e-2 + 1e-3}
    expected = fp8_gemv_ref(x.double(), w, **scales).float()
    on_device = {key: v.to(device) if torch.is_tensor(v) else v for key, v in scales.items()}
    got = fp8_gemv(
        x.to(device), w.to(device), **on_device, **({"config": config} if config else {})
    )
    assert got.shape == (1, n) and got.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(
        got.cpu().float(), expected, atol=tol * expected.abs().max(), rtol=tol
    )


@pytest.mark.interpret
@pytest.mark.parametrize("blocked", [True, False], ids=["block", "row"])
@pytest.mark.parametrize(("n", "k"), [(192, 320), (37, 256)])
# block scales: 128 and 256 columns a tile sum each 128-column group, then scale it once;
# 64 scales each element (a tile narrower than a block)
@pytest.mark.parametrize("tile_k", [128, 256, 64])
def test_fp8_gemv_interpret(n, k, blocked, tile_k):
    _check_gemv(device_for("interpret"), n, k, blocked, torch.float32, config=(4, tile_k, 4, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("blocked", [True, False], ids=["block", "row"])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (1536, 4096), (300, 640)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemv_gpu(n, k, blocked, dtype):
    _check_gemv(device_for("gpu"), n, k, blocked, dtype)
