"""Linear methods (the weight format of a linear layer), chosen by name from a registry.

A new format (FP8, GGUF blocks, ...) is one module here with a :class:`LinearMethod` subclass,
registered below; kernels it needs go in ``kernels/``. Which method a model's layers take
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
    from kvflow.runtime.layers.quantization.base import LinearLayer, LinearMethod, ParamLayout
    from kvflow.runtime.layers.quantization.kv_cache import (
        KVScaleReader,
        KVScales,
        check_kv_cache_device,
        kv_cache_torch_dtype,
    )
    from kvflow.runtime.layers.quantization.unquantized import UnquantizedLinearMethod
else:  # torch-free until a name is used (kvflow.lazy)
    __getattr__ = lazy_exports(
        __name__,
        {
            ".base": ("LinearLayer", "LinearMethod", "ParamLayout"),
            ".kv_cache": (
                "KVScaleReader",
                "KVScales",
                "check_kv_cache_device",
                "kv_cache_torch_dtype",
            ),
            ".unquantized": ("UnquantizedLinearMethod",),
        },
    )

__all__ = [
    "KV_CACHE_DTYPE_FLAG_VALUES",
    "LINEAR_METHODS",
    "QUANTIZATION_FLAG_VALUES",
    "Fp8Scheme",
    "GgufScheme",
    "GgufSource",
    "KVScaleReader",
    "KVScales",
    "LinearLayer",
    "LinearMethod",
    "ParamLayout",
    "QuantConfig",
    "UnquantizedLinearMethod",
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
