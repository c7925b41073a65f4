"""A transformers reference for an FP8 KV cache: its cache rounds every key and value
through FP8 as kvflow's pool does (``clamp(x / scale)`` to FP8, read back times the
scale), in plain torch; and checkpoints with per-layer ``k_scale`` / ``v_scale``."""

from __future__ import annotations

from pathlib import Path

import torch
from family_parity import hf_greedy

__all__ = ["FP8", "SCALES", "add_kv_scales", "fp8_rounded_cache", "greedy_fp8", "rounded"]

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# per layer (k_scale, v_scale): the first layer's keys saturate FP8 where they exceed
# 0.005 * 448 (if kvflow ignored the scale, nothing would); the second's are large
SCALES = ((0.005, 0.02), (0.6, 1.5))


def rounded(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype).float() * scale


def fp8_rounded_cache(dtype: torch.dtype, scales: tuple[tuple[float, float], ...]):
    from transformers import DynamicCache

    class Fp8RoundedCache(DynamicCache):
        """transformers' cache, each new key and value rounded through FP8 before it is
        kept (and before attention reads it back)."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k_scale, v_scale = scales[layer_idx]
            keys = rounded(key_states, k_scale, dtype).to(key_states.dtype)
            values = rounded(value_states, v_scale, dtype).to(value_states.dtype)
            return super().update(keys, values, layer_idx, *args, **kwargs)

    return Fp8RoundedCache


def greedy_fp8(hf, batch, dtype, scales) -> list[list[int]]:
    return hf_greedy(hf, batch, cache=fp8_rounded_cache(dtype, scales))


def add_kv_scales(folder: Path, scales: tuple[tuple[float, float], ...]) -> None:
    """Write the scales into the checkpoint as FP8 checkpoints name them (one layer as the
    HF / compressed-tensors ``self_attn.k_scale``, one as ModelOpt's
    ``self_attn.k_proj.k_scale``)."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    for layer, (k_scale, v_scale) in enumerate(scales):
        attn = f"model.layers.{layer}.self_attn"
        k_name, v_name = (
            (f"{attn}.k_scale", f"{attn}.v_scale")
            if layer == 0
            else (f"{attn}.k_proj.k_scale", f"{attn}.v_proj.v_scale")
        )
        tensors[k_name] = torch.tensor(k_scale)
        tensors[v_name] = torch.tensor(v_scale)
    save_file(tensors, str(file))
