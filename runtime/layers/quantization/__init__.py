"""Linear methods (the weight format of a linear layer) and MoE methods (of a mixture's
experts), chosen by name from registries.

A new format (FP8, GGUF blocks, ...) is one module here with a :class:`LinearMethod` subclass,
registered below (with a :class:`MoEMethod` in ``MOE_METHODS`` where it serves
experts); kernels it needs go in ``kernels/``. Which method a model's layers take
comes from its checkpoint's ``quantization_config`` and ``--quantization``
(:func:`resolve_quantization`, ``config.py``; the checkpoint formats in ``formats.py``).
The KV cache's storage type and FP8 scales (``--kv-cache-dtype``) are in ``kv_cache.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.lazy import lazy_exports
from kvflow.runtime.layers.quantization.config import (
    KV_CACHE_DTYPE_FLAG_VALUES,
    QUANTIZATION_FLAG_VALUES,
    Fp8Scheme,
    GgufScheme,
    GgufSource,
    QuantConfig,
    resolve_quantization,
)
from kvflow.runtime.utils import Registry

if TYPE_CHECKING:
    from kvflow.runtime.layers.quantization.base import (
        ExpertLayer,
        LinearLayer,
        LinearMethod,
        MoEMethod,
        ParamLayout,
    )
    from kvflow.runtime.layers.quantization.kv_cache import (
        KVScaleReader,
        KVScales,
        check_kv_cache_device,
        kv_cache_torch_dtype,
    )
    from kvflow.runtime.layers.quantization.unquantized import (
        UnquantizedLinearMethod,
        UnquantizedMoEMethod,
    )
else:  # torch-free until a name is used (kvflow.lazy)
    __getattr__ = lazy_exports(
        __name__,
        {
            ".base": ("ExpertLayer", "LinearLayer", "LinearMethod", "MoEMethod", "ParamLayout"),
            ".kv_cache": (
                "KVScaleReader",
                "KVScales",
                "check_kv_cache_device",
                "kv_cache_torch_dtype",
            ),
            ".unquantized": ("UnquantizedLinearMethod", "UnquantizedMoEMethod"),
        },
    )

__all__ = [
    "KV_CACHE_DTYPE_FLAG_VALUES",
    "LINEAR_METHODS",
    "MOE_METHODS",
    "QUANTIZATION_FLAG_VALUES",
    "ExpertLayer",
    "Fp8Scheme",
    "GgufScheme",
    "GgufSource",
    "KVScaleReader",
    "KVScales",
    "LinearLayer",
    "LinearMethod",
    "MoEMethod",
    "ParamLayout",
    "QuantConfig",
    "UnquantizedLinearMethod",
    "UnquantizedMoEMethod",
    "check_kv_cache_device",
    "kv_cache_torch_dtype",
    "resolve_quantization",
]

LINEAR_METHODS: Registry[LinearMethod] = Registry("linear method")
LINEAR_METHODS.register(
    "unquantized", "kvflow.runtime.layers.quantization.unquantized:UnquantizedLinearMethod"
)
LINEAR_METHODS.register("fp8", "kvflow.runtime.layers.quantization.fp8:Fp8LinearMethod")
LINEAR_METHODS.register("gguf", "kvflow.runtime.layers.quantization.gguf:GgufLinearMethod")

# The experts of a mixture, by the same names as LINEAR_METHODS (a format without an entry
# here is refused for mixture-of-experts models by resolve_quantization)
MOE_METHODS: Registry[MoEMethod] = Registry("experts method")
MOE_METHODS.register(
    "unquantized", "kvflow.runtime.layers.quantization.unquantized:UnquantizedMoEMethod"
)
MOE_METHODS.register("fp8", "kvflow.runtime.layers.quantization.fp8_moe:Fp8MoEMethod")
