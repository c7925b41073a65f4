"""CPU projections through packed weights (kvflow's native matmul, oneDNN's prepacked linear)
match ``F.linear``, and each row count takes the path the module documents."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels import cpu, silu_and_mul_ref
from kvflow.runtime.layers import gate_up_silu, linear, matmul_weight, pack_linears, pack_weight
from kvflow.runtime.layers.linear import NATIVE_MAX_ROWS

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, rows, bias) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160, bias=bias)).to(dtype)
    assert pack_linears(model) == 1
    layer = model[0]
    x = torch.randn(rows, 96).to(dtype)
    got = linear(layer, x)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=tol, rtol=tol)


def test_the_packed_copy_is_what_runs() -> None:
    """Proves the packed path is taken: packing a different weight changes the result."""
    layer = nn.Linear(8, 4, bias=False)
    pack_linears(nn.Sequential(layer))
    x = torch.randn(3, 8)
    before = linear(layer, x)
    with torch.no_grad():
        layer.weight.mul_(2)  # the packed copy does not follow
    torch.testing.assert_close(linear(layer, x), before)
    torch.testing.assert_close(F.linear(x, layer.weight), 2 * before)


def test_matmul_weight_uses_a_packed_head() -> None:
    weight = torch.randn(50, 16)
    x = torch.randn(5, 16)
    torch.testing.assert_close(matmul_weight(x, weight, pack_weight(weight)), x @ weight.T)
    # another dtype than the packed one falls back to F.linear
    torch.testing.assert_close(
        matmul_weight(x.double(), weight.double(), pack_weight(weight)),
        x.double() @ weight.double().T,
    )


def test_not_packed_where_it_does_not_apply() -> None:
    assert pack_weight(torch.randn(4, 4).half()) is None
    assert pack_weight(torch.randn(4)) is None
    layer = nn.Linear(4, 4).half()
    assert pack_linears(nn.Sequential(layer)) == 0


@pytest.mark.skipif(not cpu.available(), reason="no C compiler for the native kernels")
def test_which_layouts_are_packed_and_which_runs(monkeypatch) -> None:
    """float32 keeps both layouts (native up to NATIVE_MAX_ROWS rows, oneDNN above);
    bfloat16 keeps the native one where the CPU has AVX512-BF16."""
    calls = []
    real = cpu.gemm.gemm
    monkeypatch.setattr(
        cpu.gemm, "gemm", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k)
    )
    packed = pack_weight(torch.randn(40, 32))
    assert packed.native is not None and packed.onednn is not None
    x = torch.randn(NATIVE_MAX_ROWS + 1, 32)
    packed.matmul(x[:NATIVE_MAX_ROWS])
    packed.matmul(x)
    assert calls == [NATIVE_MAX_ROWS]  # the larger block went to oneDNN
    bf16 = pack_weight(torch.randn(40, 32).bfloat16())
    if cpu.gemm.supports(torch.empty(1, 2, dtype=torch.bfloat16)):
        assert bf16.native is not None and bf16.onednn is None
    else:
        assert bf16.native is None and bf16.onednn is not None


def test_without_native_kernels_only_onednn_is_packed(monkeypatch) -> None:
    monkeypatch.setattr(cpu, "available", lambda: False)
    packed = pack_weight(torch.randn(8, 4).bfloat16())
    assert packed.native is None and packed.onednn is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 32, NATIVE_MAX_ROWS + 72])
def test_gate_up_silu_matches_the_unfused_layers(dtype, rows) -> None:
    """The merged [gate; up] projection packed for the fused SwiGLU gives silu(gate) * up,
    and plain `linear` on the same layer still gives the plain product."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 2 * 48, bias=False).to(dtype)
    pack_linears(nn.Sequential(layer), gate_up=(layer,))
    x = torch.randn(rows, 64).to(dtype)
    product = F.linear(x, layer.weight)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        gate_up_silu(layer, x), silu_and_mul_ref(product), atol=tol, rtol=tol
    )
    torch.testing.assert_close(linear(layer, x), product, atol=tol, rtol=tol)
