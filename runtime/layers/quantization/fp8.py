"""FP8 weights (``float8_e4m3fn``) with per-tensor, per-channel or block scales, as the
checkpoint formats of ``formats.py`` store them, or a float checkpoint quantized per
channel at load (``--quantization fp8``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvflow.kernels import (
    FP8_DTYPE,
    FP8_MAX,
    fp8_gemv,
    fp8_kernels_take,
    fp8_rowwise_mm,
    per_token_group_quant_fp8,
    w8a8_block_fp8_matmul,
)
from kvflow.runtime.layers.matmul import one_row
from kvflow.runtime.layers.quantization.base import LinearLayer, LinearMethod, ParamLayout
from kvflow.runtime.layers.quantization.config import Fp8Scheme
from kvflow.runtime.layers.quantization.fp8_utils import (
    dequantize,
    quantize_per_channel,
    row_scales,
)
from kvflow.runtime.layers.quantization.unquantized import UnquantizedLinearMethod

__all__ = ["Fp8LinearMethod"]
logger = logging.getLogger(__name__)

_STATE = "fp8_state"
_INPUT_SCALE = "input_scale"  # a static per-tensor activation scale, per shard


@dataclass(frozen=True)
class _Fp8Weights:
    """What :meth:`Fp8LinearMethod.apply` runs on where the FP8 kernels run: the FP8 weight
    ``[N, K]`` and either ``row_scale`` ``[1, N]`` (``torch._scaled_mm``, with
    ``input_scale`` a static per-tensor activation scale or None for per-token scales) or
    ``block_scale`` (the Triton block GEMM, activations quantized per group of
    ``block_size[1]``)."""

    weight: torch.Tensor
    row_scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    block_scale: torch.Tensor | None = None
    block_size: tuple[int, int] | None = None


class Fp8LinearMethod(LinearMethod):
    """Parameters named as the checkpoints name them: ``weight`` FP8 ``[N, K]``, the weight
    scales under ``scheme.scale_name`` (``tensor``: one per shard ``[shards]``;
    ``channel``: ``[N, 1]``; ``block``: ``[sum(ceil(Ni / bn)), ceil(K / bk)]``, each shard's
    blocks stacked) and, with static activations, ``input_scale`` ``[shards]``. A float
    checkpoint (``scheme.serialized`` False) loads a float ``weight`` that is quantized per
    channel after loading.

    After loading, on CPU the weight is dequantized once into the model's dtype and runs
    the float path of :class:`UnquantizedLinearMethod` (no FP8 arithmetic on CPU: it keeps
    the float memory footprint and computes what the dequantized checkpoint computes; the
    float weight replaces the FP8 one, so weights load again only into a fresh model).

    On CUDA (and on CPU under Triton's interpreter, for tests) per-tensor and per-channel
    scales become one scale per row and run ``torch._scaled_mm`` with activations
    quantized per token (or by the static ``input_scale``, the largest of the shards');
    block scales run the Triton block GEMM with activations quantized per token and group
    of ``bk`` columns. A single CUDA row (batch-1 decode) runs the FP8-weight GEMV on the
    float activation instead. A layer whose shapes the kernels do not take (``K`` or ``N``
    not a multiple of 16; a shard not a whole number of blocks) is dequantized as on CPU,
    with a warning.
    """

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme
        self.float_method = UnquantizedLinearMethod()

    def create_weights(
        self,
        layer: LinearLayer,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
    ) -> None:
        self.float_method.create_weights(layer, input_size, output_sizes, bias)
        setattr(layer, _STATE, None)
        if not self.scheme.serialized:
            return
        weight = torch.empty(sum(output_sizes), input_size, dtype=FP8_DTYPE)
        self._register(layer, "weight", weight, ParamLayout())
        shards = len(output_sizes)
        if self.scheme.weight == "tensor":
            scale, layout = torch.empty(shards), ParamLayout(None, None)
        elif self.scheme.weight == "channel":
            scale, layout = torch.empty(sum(output_sizes), 1), ParamLayout(1, None)
        else:
            assert self.scheme.block_size is not None
            block_n, block_k = self.scheme.block_size
            layout = ParamLayout(block_n, block_k)
            rows = sum(layout.entries(n) for n in output_sizes)
            scale = torch.empty(rows, -(-input_size // block_k))
        self._register(layer, self.scheme.scale_name, scale, layout)
        if self.scheme.static_input:
            self._register(layer, _INPUT_SCALE, torch.empty(shards), ParamLayout(None, None))

    @staticmethod
    def _register(layer: LinearLayer, name: str, tensor: torch.Tensor, layout: ParamLayout) -> None:
        layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        layer.param_layouts[name] = layout
        layer.param_dtypes[name] = tensor.dtype

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        scheme, sizes = self.scheme, layer.output_sizes
        if scheme.serialized:
            weight, scale = layer.weight.data, getattr(layer, scheme.scale_name).data
        else:
            weight, scale = quantize_per_channel(layer.weight.data)
            scheme = Fp8Scheme(weight="channel", serialized=False)
        state = (
            self._kernel_state(layer, weight, scale, scheme) if fp8_kernels_take(weight) else None
        )
        if state is None:
            dtype = layer.compute_dtype
            layer.weight = nn.Parameter(
                dequantize(weight, scale, scheme, sizes, dtype), requires_grad=False
            )
            layer.param_dtypes.pop("weight", None)
            self.float_method.process_weights_after_loading(layer)
        else:
            layer.weight = nn.Parameter(state.weight, requires_grad=False)
            layer.param_dtypes["weight"] = FP8_DTYPE
        setattr(layer, _STATE, state)

    def _kernel_state(
        self, layer: LinearLayer, weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme
    ) -> _Fp8Weights | None:
        """The kernels' tensors for this layer, or None where they do not take its shapes."""
        rows, cols = weight.shape
        if scheme.weight == "block":
            assert scheme.block_size is not None
            block_n, block_k = scheme.block_size
            whole = all(n % block_n == 0 for n in layer.output_sizes)
            if whole and block_k >= 16 and block_k & (block_k - 1) == 0:
                return _Fp8Weights(
                    weight, block_scale=scale.float().contiguous(), block_size=(block_n, block_k)
                )
        elif rows % 16 == 0 and cols % 16 == 0:
            row_scale = row_scales(scale, scheme, layer.output_sizes).view(1, -1).contiguous()
            input_scale = None
            if scheme.static_input:
                input_scale = getattr(layer, _INPUT_SCALE).data.float().max().reshape(1, 1)
            return _Fp8Weights(weight.contiguous(), row_scale=row_scale, input_scale=input_scale)
        logger.warning(
            "FP8 layer of %d x %d with %s scales: no FP8 kernel takes it, dequantized",
            rows,
            cols,
            scheme.weight,
        )
        return None

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        state: _Fp8Weights | None = layer.__dict__[_STATE]
        if state is None:
            return self.float_method.apply(layer, x)
        rows = x.reshape(-1, x.shape[-1])
        if one_row(rows):
            out = fp8_gemv(rows, state.weight, state.row_scale, state.block_scale, state.block_size)
        elif state.block_size is not None:
            assert state.block_scale is not None
            xq, x_scale = per_token_group_quant_fp8(_unit_stride(rows), state.block_size[1])
            out = w8a8_block_fp8_matmul(
                xq, x_scale, state.weight, state.block_scale, state.block_size, x.dtype
            )
        else:
            assert state.row_scale is not None
            if state.input_scale is None:
                xq, x_scale = per_token_group_quant_fp8(_unit_stride(rows), rows.shape[-1])
            else:
                xq = (rows.float() / state.input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
                x_scale = state.input_scale.expand(rows.shape[0], 1)
            out = fp8_rowwise_mm(xq, x_scale.contiguous(), state.weight, state.row_scale, x.dtype)
        if layer.bias is not None:
            out = out + layer.bias
        return out.view(*x.shape[:-1], out.shape[-1])


def _unit_stride(rows: torch.Tensor) -> torch.Tensor:
    return rows if rows.stride(1) == 1 else rows.contiguous()
