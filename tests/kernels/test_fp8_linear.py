"""The FP8 linear method on its kernels (``torch._scaled_mm`` with per-token or static
activation scales, the Triton block GEMM with per-token-group activation scales, and a
float weight quantized at load), on QKV, gate-up and row-parallel layers whose checkpoint
tensors go through the layers' weight_loader, against the float weight the tensors stand
for.

The kernels quantize the activations to FP8 (3 mantissa bits) and the reference does not,
so the bound is on the relative error of the output: 0.05 (0.03 was seen with static
per-tensor activation scales under the interpreter, which rounds them in torch); under the
interpreter, whose own FP8 rounding drops a carry (see test_fp8_gemm.py), 0.1 (0.07 seen).
A wrong scale layout or shard placement (scales drawn in [0.5, 1.5]) is an error of 0.3 or
more.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import device_for

from kvflow.runtime.layers import GateUpLinear, QKVLinear, RowParallelLinear
from kvflow.runtime.layers.quantization import Fp8Scheme
from kvflow.runtime.layers.quantization.fp8 import Fp8LinearMethod
from kvflow.runtime.layers.quantization.fp8_utils import dequantize, quantize_per_channel

SCHEMES = {
    "tensor-static": Fp8Scheme("tensor", static_input=True),
    "tensor-dynamic": Fp8Scheme("tensor"),
    "channel-dynamic": Fp8Scheme("channel"),
    "block": Fp8Scheme("block", block_size=(128, 128), scale_name="weight_scale_inv"),
    "online": Fp8Scheme("channel", serialized=False),
}


def _layer(kind: str, method: Fp8LinearMethod, device: str):
    with torch.device(device):
        if kind == "qkv":
            layer = QKVLinear(512, 128, 4, 2, False, method)
        elif kind == "gate_up":
            layer = GateUpLinear(512, 384, method)
        else:
            layer = RowParallelLinear(768, 512, True, method)
    layer.compute_dtype = torch.bfloat16
    for name, param in layer.named_parameters():
        if name not in layer.param_dtypes:
            param.data = param.data.to(torch.bfloat16)
    return layer


def _fill(layer, scheme: Fp8Scheme, gen: torch.Generator, device: str) -> torch.Tensor:
    """Random checkpoint tensors through the layer's weight_loader, shard by shard; returns
    the float weight the layer is to compute with."""
    for shard, rows in zip(layer.shard_ids, layer.output_sizes, strict=True):
        weight = torch.randn(rows, layer.input_size, generator=gen) * 0.05
        if not scheme.serialized:
            layer.weight_loader(layer.weight, weight.to(torch.bfloat16).to(device), shard)
            continue
        layer.weight_loader(layer.weight, weight.to(torch.float8_e4m3fn).to(device), shard)
        layout = layer.param_layouts[scheme.scale_name]
        shape = {"tensor": (), "channel": (rows, 1)}.get(
            scheme.weight, (layout.entries(rows), -(-layer.input_size // 128))
        )
        scale = (torch.rand(shape, generator=gen) + 0.5).to(device)
        layer.weight_loader(getattr(layer, scheme.scale_name), scale, shard)
        if scheme.static_input:
            layer.weight_loader(layer.input_scale, torch.tensor(0.02).to(device), shard)
    if layer.bias is not None:
        layer.bias.data.normal_(0, 0.1, generator=None)
    if not scheme.serialized:
        q, s = quantize_per_channel(layer.weight.data)
        return q.float() * s
    scale = getattr(layer, scheme.scale_name).data
    return dequantize(layer.weight.data, scale, scheme, layer.output_sizes, torch.float32)


def _check(device: str, scheme_name: str, kind: str, rows: int, tolerance: float) -> None:
    scheme = SCHEMES[scheme_name]
    gen = torch.Generator().manual_seed(rows)
    layer = _layer(kind, Fp8LinearMethod(scheme), device)
    weight = _fill(layer, scheme, gen, device)
    layer.process_weights_after_loading()
    assert layer.__dict__["fp8_state"] is not None  # the FP8 kernels run, not a fallback
    assert layer.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(rows, layer.input_size, generator=gen).to(torch.bfloat16).to(device)
    if scheme.static_input:
        x = x.clamp(-8, 8)  # within the static scale's range (448 * 0.02)
    got = layer(x)
    expected = x.float() @ weight.T
    if layer.bias is not None:
        expected += layer.bias.float()
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    error = ((got.float() - expected).norm() / expected.norm()).item()
    assert error < tolerance, error


@pytest.mark.interpret
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "row"])
@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
def test_fp8_linear_interpret(scheme_name, kind):
    _check(device_for("interpret"), scheme_name, kind, 5, 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "row"])
@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
def test_fp8_linear_gpu(scheme_name, kind, rows):
    _check(device_for("gpu"), scheme_name, kind, rows, 0.05)
