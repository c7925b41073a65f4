"""FP8 weight arithmetic shared by the FP8 linear method and tests: quantize a float weight
per output channel, and turn any checkpoint's scales (per shard, per channel, per block)
into a full dequantized weight or a per-row scale vector."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX
from kvflow.runtime.layers.quantization.config import Fp8Scheme

__all__ = ["dequantize", "quantize_per_channel", "row_scales"]


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``[N, K]`` weight -> FP8 ``[N, K]`` and float32 scales ``[N, 1]`` (each row's
    absolute maximum / 448), with ``weight ~= q * scale``."""
    scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def row_scales(scale: torch.Tensor, scheme: Fp8Scheme, output_sizes: Sequence[int]) -> torch.Tensor:
    """One float32 scale per weight row ``[N]``, from per-shard (``tensor``) or per-channel
    scales; block scales have none."""
    if scheme.weight == "channel":
        return scale.float().reshape(-1)
    if scheme.weight == "tensor":
        sizes = torch.tensor(list(output_sizes), device=scale.device)
        return scale.float().reshape(-1).repeat_interleave(sizes)
    raise ValueError("block scales are not per row")


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    scheme: Fp8Scheme,
    output_sizes: Sequence[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The float weight ``[N, K]`` in ``dtype`` an FP8 weight and its scales stand for
    (computed in float32). Block scales are stacked shard by shard, each shard's rows
    rounded up to whole blocks, as the checkpoint's tensors are."""
    if scheme.weight != "block":
        return (weight.float() * row_scales(scale, scheme, output_sizes)[:, None]).to(dtype)
    assert scheme.block_size is not None
    block_n, block_k = scheme.block_size
    cols = weight.shape[1]
    parts, row, scale_row = [], 0, 0
    for rows in output_sizes:
        entries = -(-rows // block_n)
        shard_scale = scale[scale_row : scale_row + entries].float()
        full = shard_scale.repeat_interleave(block_n, 0)[:rows].repeat_interleave(block_k, 1)
        parts.append(weight[row : row + rows].float() * full[:, :cols])
        row, scale_row = row + rows, scale_row + entries
    return torch.cat(parts).to(dtype)
