"""The KV cache's storage type (SGLang's ``--kv-cache-dtype``) and its FP8 scales.

``auto`` keeps the KV in the model's dtype; ``bfloat16`` (SGLang's ``bf16`` too) stores it
in bfloat16 whatever the model's dtype; ``fp8_e4m3`` / ``fp8_e5m2`` store it in
``float8_e4m3fn`` / ``float8_e5m2`` with one scale per layer for K and one for V
(:mod:`kvflow.kernels.kv_quant` has the rounding). The scales come from the checkpoint's
``k_scale`` / ``v_scale`` tensors (or one ``kv_scale`` for both), else 1.0, by SGLang's
rule (``BaseKVCacheMethod.process_weights_after_loading``). Unlike SGLang's newest
``auto``, a checkpoint that declares an FP8 KV cache (ModelOpt's ``kv_cache_quant_algo``)
does not switch it on: the flag does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvflow.runtime.layers.quantization.config import KV_CACHE_DTYPE_FLAG_VALUES

__all__ = [
    "KVScaleReader",
    "KVScales",
    "check_kv_cache_device",
    "kv_cache_torch_dtype",
]

_TORCH_DTYPES = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,  # SGLang's other name (the CLI maps it to bfloat16)
}


def kv_cache_torch_dtype(flag: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's storage dtype for a ``--kv-cache-dtype`` value."""
    if flag == "auto":
        return model_dtype
    if flag not in _TORCH_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {flag}: kvflow stores the KV cache as "
            f"{', '.join(KV_CACHE_DTYPE_FLAG_VALUES)}"
        )
    return _TORCH_DTYPES[flag]


def check_kv_cache_device(flag: str, device: str) -> None:
    """Refuse (ValueError, one line) an FP8 format the device's kernels cannot convert:
    Triton converts ``float8_e4m3fn`` from compute capability 8.9 (Ada, Hopper) on."""
    if flag != "fp8_e4m3" or not device.startswith("cuda"):
        return
    capability = torch.cuda.get_device_capability(torch.device(device))
    if capability < (8, 9):
        raise ValueError(
            f"--kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8.9 or newer "
            f"(this one: {capability[0]}.{capability[1]}); use fp8_e5m2 or auto"
        )


@dataclass(frozen=True)
class KVScales:
    """Per-layer FP8 KV scales: ``k[layer]`` and ``v[layer]`` (stored = x / scale)."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers)


# a layer's KV scale tensor as checkpoints name them (model. prefix removed): the HF fp8 and
# compressed-tensors self_attn.{k,v}_scale, ModelOpt's self_attn.{k,v}_proj.{k,v}_scale,
# AutoFP8's older self_attn.kv_scale (one for both)
_SCALE_NAME = re.compile(r"^layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?(k_scale|v_scale|kv_scale)$")


class KVScaleReader:
    """Collects a checkpoint's KV scale tensors while the weights load (:meth:`take`), then
    resolves them per layer (:meth:`scales`)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._found: dict[tuple[int, str], float] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep ``tensor`` if ``name`` (without ``model.``) is a KV scale; whether it was.
        A scale that is not one number (per head, per channel) is refused: the pool keeps
        one scale per layer for K and one for V, as SGLang's does."""
        match = _SCALE_NAME.match(name)
        if match is None:
            return False
        if tensor.numel() != 1:
            raise ValueError(
                f"checkpoint KV scale {name!r} has {tensor.numel()} values: kvflow's FP8 KV "
                "cache takes one scale per layer for K and one for V"
            )
        layer = int(match[1])
        if layer >= self.num_layers:
            raise KeyError(f"checkpoint tensor {name!r} names a layer the model lacks")
        self._found[(layer, match[2])] = float(tensor.float().item())
        return True

    def scales(self) -> KVScales:
        """SGLang's rule per layer: k_scale and v_scale when both are positive; neither:
        1.0; one of them (or kv_scale): the larger for both."""
        k_scales, v_scales = [], []
        for layer in range(self.num_layers):
            shared = self._found.get((layer, "kv_scale"), -1.0)
            k = self._found.get((layer, "k_scale"), shared)
            v = self._found.get((layer, "v_scale"), shared)
            if k <= 0 and v <= 0:
                k = v = 1.0
            elif k <= 0 or v <= 0:
                k = v = max(k, v)
            k_scales.append(k)
            v_scales.append(v)
        return KVScales(tuple(k_scales), tuple(v_scales))
