"""CPU projections through oneDNN-prepacked weights match ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.runtime.layers import linear, matmul_weight, pack_linears, pack_weight

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
