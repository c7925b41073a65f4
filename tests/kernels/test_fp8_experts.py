"""The FP8 experts method (``Fp8MoEMethod``) on a layer's experts whose per-expert
checkpoint tensors go through the weight_loader, against the float weights the tensors
stand for: on the fused kernel (interpreted, or compiled on CUDA) with the scales it
derives (per-tensor and per-channel scales per row, 128x128 blocks, repeated per row where
gate and up end inside a block), and dequantized at load on plain CPU.

The kernel reads FP8 weights and keeps the activations in their dtype (W8A16), so with
float32 activations it equals the float weights' result to float32 rounding; bf16 on CUDA
within 3e-2. A wrong scale (drawn in [0.5, 1.5]) or misplaced shard is off by far more.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import INTERPRETED, device_for

from kvflow.kernels import FP8_DTYPE, fused_moe_ref
from kvflow.runtime.layers import Experts, TopK, select_experts
from kvflow.runtime.layers.quantization import Fp8Scheme
from kvflow.runtime.layers.quantization.fp8_moe import Fp8MoEMethod

SCHEMES = {
    "tensor-static": Fp8Scheme("tensor", static_input=True),
    "channel": Fp8Scheme("channel"),
    "block": Fp8Scheme("block", block_size=(128, 128), scale_name="weight_scale_inv"),
    "online": Fp8Scheme("channel", serialized=False),
}
EXPERTS, HIDDEN, INTER = 4, 256, 160  # gate and up each end inside a 128-row block


def _expand(scale: torch.Tensor, rows: int, cols: int, scheme: Fp8Scheme) -> torch.Tensor:
    if scheme.weight != "block":
        return scale.reshape(-1, 1).expand(rows, cols)
    bn, bk = scheme.block_size
    return scale.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]


def _fill(projection, scheme: Fp8Scheme, gen: torch.Generator, device: str) -> torch.Tensor:
    """Random per-expert checkpoint tensors through the weight_loader; returns the float
    weights ``[E, N, K]`` they stand for."""
    experts = []
    for expert in range(EXPERTS):
        parts = []
        for part, rows in enumerate(projection.output_sizes):
            cols, shard = projection.input_size, (expert, part)
            weight = torch.randn(rows, cols, generator=gen) * 0.05
            if not scheme.serialized:
                projection.weight_loader(projection.weight, weight.to(device), shard)
                parts.append(weight)
                continue
            q = weight.to(FP8_DTYPE)
            shape = {"tensor": (), "channel": (rows, 1)}.get(
                scheme.weight, (-(-rows // 128), -(-cols // 128))
            )
            scale = torch.rand(shape, generator=gen) + 0.5
            projection.weight_loader(projection.weight, q.to(device), shard)
            target = getattr(projection, scheme.scale_name)
            projection.weight_loader(target, scale.to(device), shard)
            if scheme.static_input:  # loaded, not applied (W8A16)
                projection.weight_loader(projection.input_scale, torch.tensor(0.02), shard)
            parts.append(q.float() * _expand(scale, rows, cols, scheme))
        experts.append(torch.cat(parts))
    return torch.stack(experts)


def _check(device: str, scheme_name: str, dtype: torch.dtype, tokens: int, kernel: bool) -> None:
    scheme, gen = SCHEMES[scheme_name], torch.Generator().manual_seed(3)
    with torch.device(device):
        experts = Experts(EXPERTS, HIDDEN, INTER, None, Fp8MoEMethod(scheme))
    for projection in (experts.w13, experts.w2):
        projection.compute_dtype = dtype
    w13, w2 = _fill(experts.w13, scheme, gen, device), _fill(experts.w2, scheme, gen, device)
    if not scheme.serialized:  # the reference rounds as the method does, per channel
        w13, w2 = (_channel_round(w) for w in (w13, w2))
    for projection in (experts.w13, experts.w2):
        projection.process_weights_after_loading()
        assert (projection.weight.dtype == FP8_DTYPE) == kernel  # else dequantized at load
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    topk = select_experts(torch.randn(tokens, EXPERTS, generator=gen), 2, True)
    got = experts(hidden.to(dtype).to(device), TopK(*(t.to(device) for t in topk)))
    expected = fused_moe_ref(hidden.to(dtype).double(), w13.double(), w2.double(), *topk)
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu().float(), expected.float(), atol=tol, rtol=tol)


def _channel_round(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    return (w / scale).clamp(-448, 448).to(FP8_DTYPE).float() * scale


@pytest.mark.interpret
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fp8_experts_on_the_kernel_interpret(scheme):
    _check(device_for("interpret"), scheme, torch.float32, 9, kernel=True)


@pytest.mark.skipif(INTERPRETED, reason="under the interpreter the kernel path runs instead")
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fp8_experts_dequantized_on_cpu(scheme):
    _check("cpu", scheme, torch.float32, 9, kernel=False)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("tokens", [1, 37])
def test_fp8_experts_on_the_kernel_gpu(scheme, tokens):
    _check(device_for("gpu"), scheme, torch.bfloat16, tokens, kernel=True)
