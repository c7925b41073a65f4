"""CPU projections through packed weights (kvflow's native matmul, oneDNN's prepacked linear)
match ``F.linear``, and each row count takes the path the module documents; the linear
layers' shards land where the separate checkpoint tensors would."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels import cpu, silu_and_mul_ref
from kvflow.runtime.layers import (
    LINEAR_METHODS,
    GateUpLinear,
    LinearBase,
    MergedColumnLinear,
    QKVLinear,
    ReplicatedLinear,
    UnquantizedLinearMethod,
    matmul_weight,
    pack_weight,
)
from kvflow.runtime.layers.matmul import NATIVE_MAX_ROWS

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _loaded(layer: LinearBase, dtype: torch.dtype = torch.float32) -> LinearBase:
    """``layer`` with random weights, processed as the model loader does."""
    layer = layer.to(dtype)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_()
    layer.process_weights_after_loading()
    return layer


def _weight_and_bias(input_size: int, output_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a checkpoint holds for one separate projection."""
    return torch.randn(output_size, input_size), torch.randn(output_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, rows, bias) -> None:
    torch.manual_seed(0)
    layer = _loaded(ReplicatedLinear(96, 160, bias), dtype)
    assert layer.packed_weight is not None
    x = torch.randn(rows, 96).to(dtype)
    got = layer(x)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=tol, rtol=tol)


def test_the_packed_copy_is_what_runs() -> None:
    """Proves the packed path is taken: packing a different weight changes the result."""
    layer = _loaded(ReplicatedLinear(8, 4, bias=False))
    x = torch.randn(3, 8)
    before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)  # the packed copy does not follow
    torch.testing.assert_close(layer(x), before)
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
    layer = _loaded(ReplicatedLinear(4, 4, bias=True), torch.half)
    assert layer.packed_weight is None
    x = torch.randn(2, 4).half()
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


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
    layer = _loaded(GateUpLinear(64, 48), dtype)
    x = torch.randn(rows, 64).to(dtype)
    product = F.linear(x, layer.weight)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(layer.silu_mul(x), silu_and_mul_ref(product), atol=tol, rtol=tol)
    torch.testing.assert_close(layer(x), product, atol=tol, rtol=tol)


def test_unquantized_method_creates_what_f_linear_takes() -> None:
    """The registry's one method: ``weight`` [N, K] and ``bias`` [N]; before processing
    (nothing packed) and after, ``apply`` is ``F.linear``."""
    method = LINEAR_METHODS.get("unquantized")()
    assert isinstance(method, UnquantizedLinearMethod)
    layer = MergedColumnLinear(24, [16, 8], bias=True, method=method)
    assert layer.weight.shape == (24, 24) and layer.bias.shape == (24,)
    with torch.no_grad():
        layer.weight.normal_(), layer.bias.normal_()
    x = torch.randn(5, 24)
    expected = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(method.apply(layer, x), expected)
    method.process_weights_after_loading(layer)
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)


def test_qkv_weight_loader_places_shards_as_the_separate_projections() -> None:
    """q, k and v tensors (and biases) loaded by shard id give the outputs of the three
    separate projections, in that order along the last dimension."""
    torch.manual_seed(0)
    hidden, head_dim, heads, kv_heads = 32, 8, 4, 2
    separate = {
        "q": _weight_and_bias(hidden, heads * head_dim),
        "k": _weight_and_bias(hidden, kv_heads * head_dim),
        "v": _weight_and_bias(hidden, kv_heads * head_dim),
    }
    layer = QKVLinear(hidden, head_dim, heads, kv_heads, bias=True)
    for shard, (weight, bias) in separate.items():
        layer.weight_loader(layer.weight, weight, shard)
        layer.weight_loader(layer.bias, bias, shard)
    layer.process_weights_after_loading()
    x = torch.randn(3, hidden)
    expected = torch.cat([F.linear(x, w, b) for w, b in separate.values()], dim=-1)
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)
    assert layer.output_sizes == (32, 16, 16)


def test_gate_up_weight_loader_matches_the_separate_projections() -> None:
    torch.manual_seed(0)
    gate, up = torch.randn(40, 16), torch.randn(40, 16)
    layer = GateUpLinear(16, 40)
    layer.weight_loader(layer.weight, up, 1)  # any order
    layer.weight_loader(layer.weight, gate, 0)
    layer.process_weights_after_loading()
    x = torch.randn(7, 16)
    expected = F.silu(F.linear(x, gate)) * F.linear(x, up)
    torch.testing.assert_close(layer.silu_mul(x), expected, atol=1e-4, rtol=1e-4)


def test_weight_loader_rejects_a_wrong_shape_or_shard() -> None:
    layer = QKVLinear(16, 4, 2, 1, bias=False)
    with pytest.raises(ValueError, match="shard 'k'"):
        layer.weight_loader(layer.weight, torch.zeros(8, 16), "k")
    with pytest.raises(KeyError):
        layer.weight_loader(layer.weight, torch.zeros(4, 16), "o")
