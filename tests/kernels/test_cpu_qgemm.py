"""The native GGUF-block matmul (``qgemm.c``) against its torch reference (``gguf``'s
dequantize, then the float32 matmul): both block types, both activation dtypes, row counts
around the 4-row quantized tiles, the switch to dequantized panels (16 rows), their 8-row
tiles and 256-row passes, and column counts around the 16-column panels and panel pairs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from kvflow.kernels.cpu import available, qgemm

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler for the native kernels")


def _raw(n: int, k: int, block_type: str, seed: int) -> torch.Tensor:
    weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    return torch.from_numpy(quantize(weights, GGMLQuantizationType[block_type]))


@pytest.mark.parametrize("block_type", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 15, 16, 17, 300])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (1, 64), (33, 96), (50, 576), (250, 160)])
def test_matches_reference(block_type, dtype, rows, n, k) -> None:
    raw = _raw(n, k, block_type, seed=rows * 1000 + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    got = qgemm.qgemm(x, qgemm.pack(raw, block_type, dtype))
    want = qgemm.qgemm_ref(x, raw, block_type)
    # float32: sums in another order; bfloat16: the same float32 sum rounded once (1 ulp)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (33, 96), (250, 576)])
def test_rows_read_from_q8_0_panels_equal_the_dequantized_rows(dtype, n, k) -> None:
    raw = _raw(n, k, "Q8_0", seed=n)
    packed = qgemm.pack(raw, "Q8_0", torch.bfloat16 if dtype == torch.float16 else dtype)
    ids = torch.tensor([[0, n - 1, n // 2], [n - 1, 0, min(16, n - 1)]])
    dense = qgemm.dequantize(raw, "Q8_0").to(dtype)  # what the float embedding held
    assert torch.equal(qgemm.dequantize_rows(packed, ids, dtype), dense[ids])
    assert torch.equal(qgemm.dequantize_rows(packed, torch.arange(n), dtype), dense)


def test_rows_are_read_from_q8_0_panels_only() -> None:
    packed = qgemm.pack(_raw(16, 64, "Q4_1", 0), "Q4_1", torch.float32)
    with pytest.raises(ValueError, match="Q8_0 panels only"):
        qgemm.dequantize_rows(packed, torch.tensor([0]), torch.float32)


def test_bfloat16_q4_1_takes_the_vdpbf16ps_layout_where_the_cpu_has_it() -> None:
    packed = qgemm.pack(_raw(16, 64, "Q4_1", 0), "Q4_1", torch.bfloat16)
    assert packed.panels.shape == (1, 2, 320)  # same bytes as GGUF's 16 x 2 blocks of 20
    if packed.layout == 2:  # vdpbf16ps panels run bfloat16 activations only
        assert not packed.takes(torch.zeros(1, 64))


def test_strided_rows_and_an_output_view() -> None:
    raw = _raw(20, 64, "Q8_0", 1)
    x = torch.randn(5, 96)[:, 16:80]
    out_storage = torch.zeros(5, 30)
    out = out_storage[:, 5:25]
    qgemm.qgemm(x, qgemm.pack(raw, "Q8_0", torch.float32), out=out)
    torch.testing.assert_close(out, qgemm.qgemm_ref(x, raw, "Q8_0"), atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(out_storage[:, :5]) == 0
    assert torch.count_nonzero(out_storage[:, 25:]) == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: qgemm.qgemm(torch.randn(2, 64).double(), p), "x must be"),
        (lambda p: qgemm.qgemm(torch.randn(2, 32), p), "x must be"),
        (lambda p: qgemm.qgemm(torch.randn(2, 64), p, out=torch.empty(2, 5)), "out must be"),
        (
            lambda p: qgemm.pack(torch.zeros(4, 30, dtype=torch.uint8), "Q8_0", torch.float32),
            "rows",
        ),
        (
            lambda p: qgemm.pack(torch.zeros(4, 34, dtype=torch.uint8), "Q6_K", torch.float32),
            "Q6_K",
        ),
    ],
)
def test_bad_arguments_are_refused(call, message) -> None:
    packed = qgemm.pack(_raw(4, 64, "Q8_0", 2), "Q8_0", torch.float32)
    with pytest.raises(ValueError, match=message):
        call(packed)
