"""FP8 experts of a mixture (SGLang's ``Fp8MoEMethod``): every expert's projection stored
as the checkpoint formats of ``formats.py`` store a linear layer's, stacked over the
experts, or a float checkpoint quantized per channel at load (``--quantization fp8``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from kvflow.kernels import FP8_DTYPE, ExpertScales, fp8_kernels_take, fused_moe
from kvflow.runtime.layers.moe_compute import TopK, fused_experts
from kvflow.runtime.layers.quantization.base import ExpertLayer, MoEMethod, ParamLayout
from kvflow.runtime.layers.quantization.config import Fp8Scheme
from kvflow.runtime.layers.quantization.fp8_utils import dequantize, quantize_per_channel

__all__ = ["Fp8MoEMethod"]
logger = logging.getLogger(__name__)

_STATE = "fp8_expert_scales"
_INPUT_SCALE = "input_scale"  # a static activation scale per expert and part: not applied


class Fp8MoEMethod(MoEMethod):
    """Parameters named as the checkpoints name each expert's, with a leading expert
    dimension: ``weight`` FP8 ``[E, N, K]``; the scales under ``scheme.scale_name``
    (``tensor``: ``[E, parts]``; ``channel``: ``[E, N, 1]``; ``block``: ``[E,
    sum(ceil(Ni / bn)), ceil(K / bk)]``, each part's blocks stacked); with static
    activations the checkpoint's ``input_scale`` ``[E, parts]``, loaded and not applied
    (the activations stay in the model's dtype, below). A float checkpoint
    (``scheme.serialized`` False) loads a float ``weight``, quantized per channel of each
    expert after loading.

    On CPU the weights are dequantized once into the model's dtype and run the float
    experts (what the dequantized checkpoint computes). On CUDA (and on CPU under Triton's
    interpreter, for tests) they stay FP8 and the fused MoE kernel reads them with a
    float32 scale per row (per-tensor and per-channel scales) or per block; a part that
    ends inside a block row gets its block scales repeated per row. This is W8A16: the
    kernel converts the FP8 weights to the activations' dtype (exact) and accumulates in
    float32; activations are not quantized, so a checkpoint's static ``input_scale`` plays
    no part. Block columns that are not a power of two >= 16, and GPUs before compute
    capability 8.9, get dequantized weights, with a warning.
    """

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(
        self, layer: ExpertLayer, num_experts: int, input_size: int, output_sizes: Sequence[int]
    ) -> None:
        setattr(layer, _STATE, None)
        rows, parts = sum(output_sizes), len(output_sizes)
        if not self.scheme.serialized:
            weight = torch.empty(num_experts, rows, input_size)
            layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
            return
        weight = torch.empty(num_experts, rows, input_size, dtype=FP8_DTYPE)
        _register(layer, "weight", weight, ParamLayout())
        if self.scheme.weight == "tensor":
            scale, layout = torch.empty(num_experts, parts), ParamLayout(None, None)
        elif self.scheme.weight == "channel":
            scale, layout = torch.empty(num_experts, rows, 1), ParamLayout(1, None)
        else:
            assert self.scheme.block_size is not None
            block_n, block_k = self.scheme.block_size
            layout = ParamLayout(block_n, block_k)
            entries = sum(layout.entries(n) for n in output_sizes)
            scale = torch.empty(num_experts, entries, -(-input_size // block_k))
        _register(layer, self.scheme.scale_name, scale, layout)
        if self.scheme.static_input:
            input_scale = torch.empty(num_experts, parts)
            _register(layer, _INPUT_SCALE, input_scale, ParamLayout(None, None))

    def process_weights_after_loading(self, layer: ExpertLayer) -> None:
        scheme, sizes = self.scheme, layer.output_sizes
        if scheme.serialized:
            weight, scale = layer.weight.data, getattr(layer, scheme.scale_name).data
        else:
            experts, rows, cols = layer.weight.shape
            flat, flat_scale = quantize_per_channel(layer.weight.data.reshape(-1, cols))
            weight, scale = flat.view(experts, rows, cols), flat_scale.view(experts, rows, 1)
            scheme = Fp8Scheme(weight="channel", serialized=False)
        scales = _kernel_scales(scale, scheme, sizes) if _kernel_takes(weight) else None
        if scales is None:
            dtype = layer.compute_dtype
            float_weight = torch.stack(
                [dequantize(weight[e], scale[e], scheme, sizes, dtype) for e in range(len(weight))]
            )
            layer.weight = nn.Parameter(float_weight, requires_grad=False)
            layer.param_dtypes.pop("weight", None)
        else:
            layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
            layer.param_dtypes["weight"] = FP8_DTYPE
        setattr(layer, _STATE, scales)

    def apply(
        self, w13: ExpertLayer, w2: ExpertLayer, hidden: torch.Tensor, topk: TopK
    ) -> torch.Tensor:
        w13_scales: ExpertScales | None = w13.__dict__[_STATE]
        w2_scales: ExpertScales | None = w2.__dict__[_STATE]
        if w13_scales is None or w2_scales is None:  # dequantized at load
            return fused_experts(hidden, w13.weight, w2.weight, topk)
        return fused_moe(
            hidden, w13.weight, w2.weight, topk.weights, topk.ids, w13_scales, w2_scales
        )


def _register(layer: ExpertLayer, name: str, tensor: torch.Tensor, layout: ParamLayout) -> None:
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
    layer.param_layouts[name] = layout
    layer.param_dtypes[name] = tensor.dtype


def _kernel_takes(weight: torch.Tensor) -> bool:
    """Whether the fused kernel reads FP8 on ``weight``'s device: CUDA from compute
    capability 8.9 (Triton converts ``float8_e4m3fn`` from Ada/Hopper on), or the
    interpreter."""
    if not fp8_kernels_take(weight):
        return False
    if weight.is_cuda and torch.cuda.get_device_capability(weight.device) < (8, 9):
        logger.warning("FP8 experts on a GPU before compute capability 8.9: dequantized")
        return False
    return True


def _kernel_scales(
    scale: torch.Tensor, scheme: Fp8Scheme, output_sizes: Sequence[int]
) -> ExpertScales | None:
    """The fused kernel's float32 scales for a projection's loaded ``scale``, or None where
    the kernel does not take them (block columns not a power of two >= 16)."""
    experts = scale.shape[0]
    if scheme.weight == "channel":
        return ExpertScales(scale.float().reshape(experts, -1).contiguous())
    if scheme.weight == "tensor":
        sizes = torch.tensor(list(output_sizes), device=scale.device)
        return ExpertScales(scale.float().repeat_interleave(sizes, dim=1).contiguous())
    assert scheme.block_size is not None
    block_n, block_k = scheme.block_size
    if block_k < 16 or block_k & (block_k - 1):
        logger.warning("FP8 experts in %s blocks: no fused kernel, dequantized", scheme.block_size)
        return None
    if all(n % block_n == 0 for n in output_sizes):
        return ExpertScales(scale.float().contiguous(), (block_n, block_k))
    parts, entry = [], 0
    for rows in output_sizes:  # a part ends inside a block row: one scale row per weight row
        entries = -(-rows // block_n)
        part = scale[:, entry : entry + entries].float()
        parts.append(part.repeat_interleave(block_n, dim=1)[:, :rows])
        entry += entries
    return ExpertScales(torch.cat(parts, dim=1).contiguous(), (1, block_k))
