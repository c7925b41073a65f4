"""The native CPU matmul (``gemm.c``) against its torch reference: float32 and bfloat16, row
counts around the 8-row tiles, column counts around the 16-column panels and panel pairs."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.cpu import available, elementwise, gemm

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler for the native kernels")


def _types() -> list[torch.dtype]:
    bf16 = gemm.supports(torch.empty(1, 2, dtype=torch.bfloat16))
    return [torch.float32, *([torch.bfloat16] if bf16 else [])]


@pytest.mark.parametrize("dtype", _types())
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 32, 67, 300])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (1, 2), (33, 96), (48, 576), (250, 130)])
def test_matches_reference(dtype, rows, n, k) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    weight = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    got = gemm.gemm(x, gemm.pack(weight), n)
    want = gemm.gemm_ref(x, weight)
    # float32: sums in another order; bfloat16: the same float32 sum rounded once (1 ulp)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_strided_rows_and_an_output_view() -> None:
    weight = torch.randn(20, 32)
    storage = torch.randn(5, 48)
    x = storage[:, 8:40]  # rows 48 apart
    out_storage = torch.zeros(5, 30)
    out = out_storage[:, 5:25]
    gemm.gemm(x, gemm.pack(weight), 20, out=out)
    torch.testing.assert_close(out, x @ weight.T, atol=1e-5, rtol=1e-5)
    assert (
        torch.count_nonzero(out_storage[:, :5]) == 0
        and torch.count_nonzero(out_storage[:, 25:]) == 0
    )


def test_layout_is_panels_of_sixteen_columns() -> None:
    weight = torch.arange(17 * 4, dtype=torch.float32).view(17, 4)
    packed = gemm.pack(weight)
    assert packed.shape == (2, 4, 16)  # 17 columns -> 2 panels, the second zero-padded
    assert torch.equal(packed[0, 1], weight[:16, 1])
    assert torch.equal(packed[1, :, 0], weight[16]) and torch.count_nonzero(packed[1, :, 1:]) == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda w, p: gemm.gemm(torch.randn(2, 8).double(), p, 4), "dtype"),
        (lambda w, p: gemm.gemm(torch.randn(8, 2).T, p, 4), "contiguous"),
        (lambda w, p: gemm.gemm(torch.randn(2, 8), p, 40), "columns"),
        (lambda w, p: gemm.gemm(torch.randn(2, 8), p, 4, out=torch.empty(2, 5)), "out"),
        (lambda w, p: gemm.pack(w.half()), "cannot pack"),
        (lambda w, p: gemm.pack(torch.randn(4, 7).bfloat16()), "cannot pack"),
    ],
)
def test_bad_arguments_are_refused(call, message) -> None:
    weight = torch.randn(4, 8)
    with pytest.raises(ValueError, match=message):
        call(weight, gemm.pack(weight))


@pytest.mark.parametrize("dtype", _types())
@pytest.mark.parametrize("rows", [1, 9, 32, 300])
@pytest.mark.parametrize("width", [16, 48, 1536])
def test_silu_mul_is_the_unfused_pair(dtype, rows, width) -> None:
    """The fused SwiGLU epilogue equals the matmul followed by the SiLU-and-mul kernel."""
    gen = torch.Generator().manual_seed(width + rows)
    weight = (torch.randn(2 * width, 64, generator=gen) * 0.3).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    got = gemm.gemm(x, gemm.pack(weight, silu_mul=True), 2 * width, silu_mul=True)
    want = elementwise.silu_and_mul(gemm.gemm(x, gemm.pack(weight), 2 * width))
    assert got.shape == (rows, width)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # expf vectorized differently: 1 ulp
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_silu_mul_needs_halves_of_whole_panels() -> None:
    assert not gemm.supports(torch.randn(40, 8), silu_mul=True)  # halves of 20 columns
    with pytest.raises(ValueError, match="cannot pack"):
        gemm.pack(torch.randn(40, 8), silu_mul=True)


@pytest.mark.parametrize("dtype", _types())
def test_bias_is_added_before_rounding(dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(40, 64, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    x = torch.randn(9, 64, generator=gen).to(dtype)
    got = gemm.gemm(x, gemm.pack(weight), 40, bias=bias)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(
        got.float(), gemm.gemm_ref(x, weight, bias).float(), atol=tol, rtol=tol
    )
    with pytest.raises(ValueError, match="bias"):
        gemm.gemm(x, gemm.pack(weight), 40, bias=bias[:5])


@pytest.fixture
def amx_tiles():
    """AMX on for the test (skipped where the library or the kernel has none); back on
    afterwards, as a process starts."""
    if not gemm.use_amx(True):
        pytest.skip("no AMX tiles on this CPU (or not granted by the kernel)")
    yield
    gemm.use_amx(True)


@pytest.mark.parametrize("rows", [1, 5, 16, 31, 32, 33, 47, 300])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (33, 96), (250, 576), (48, 130)])
@pytest.mark.parametrize("fused", ["plain", "bias", "silu_mul"])
def test_amx_tiles_equal_the_vector_tiles(amx_tiles, rows, n, k, fused) -> None:
    """Blocks of 16 and 32 rows on the tile unit, the last rows padded to 16 (k not a
    multiple of 32: the AVX512 tile), against the AVX512 tile and the float32 reference:
    within one bfloat16 rounding."""
    gen = torch.Generator().manual_seed(rows * 7 + n)
    silu_mul = fused == "silu_mul"
    n = 2 * 16 * -(-n // 32) if silu_mul else n  # halves of whole panels
    weight = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen) if fused == "bias" else None
    packed = gemm.pack(weight, silu_mul=silu_mul)
    got = gemm.gemm(x, packed, n, silu_mul=silu_mul, bias=bias)
    assert gemm.use_amx(False) is False
    vector = gemm.gemm(x, packed, n, silu_mul=silu_mul, bias=bias)
    tol = 2e-2 if silu_mul else 1e-2  # the fused pair rounds three times
    torch.testing.assert_close(got.float(), vector.float(), atol=tol, rtol=tol)
    if not silu_mul:
        want = gemm.gemm_ref(x, weight, bias)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_amx_can_be_turned_off_by_the_environment(tmp_path) -> None:
    """``KVFLOW_CPU_AMX=0``: the first use answers off (a fresh process)."""
    import os
    import subprocess
    import sys

    code = "from kvflow.kernels.cpu import gemm; print(gemm.use_amx())"
    env = {**os.environ, "KVFLOW_CPU_AMX": "0"}
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_amx_rows_do_not_depend_on_their_place_in_the_batch(amx_tiles) -> None:
    """A row's output is the same in a matmul of any row count (the last rows past a whole
    16 are padded onto the tile unit), so how requests are batched changes nothing."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(96, 576, generator=gen).bfloat16()
    packed = gemm.pack(weight)
    x = torch.randn(70, 576, generator=gen).bfloat16()
    whole = gemm.gemm(x, packed, 96)
    for lo, hi in [(0, 17), (5, 40), (3, 19), (50, 70), (1, 64), (7, 8), (60, 63)]:
        assert torch.equal(gemm.gemm(x[lo:hi].contiguous(), packed, 96), whole[lo:hi])
