"""Linear methods (the weight format of a linear layer), chosen by name from a registry.

A new format (FP8, ...) is one module here with a :class:`LinearMethod` subclass,
registered below; kernels it needs go in ``kernels/``.
"""

from kvflow.runtime.layers.quantization.base import LinearLayer, LinearMethod
from kvflow.runtime.layers.quantization.unquantized import UnquantizedLinearMethod
from kvflow.runtime.utils import Registry

__all__ = ["LINEAR_METHODS", "LinearLayer", "LinearMethod", "UnquantizedLinearMethod"]

LINEAR_METHODS: Registry[LinearMethod] = Registry("linear method")
LINEAR_METHODS.register(
    "unquantized", "kvflow.runtime.layers.quantization.unquantized:UnquantizedLinearMethod"
)
