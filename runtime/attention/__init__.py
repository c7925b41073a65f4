"""Attention backends behind one interface, chosen by name from a registry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.lazy import lazy_exports
from kvflow.runtime.utils import Registry

if TYPE_CHECKING:
    from kvflow.runtime.attention.base import AttentionBackend
else:  # torch-free until a name is used (kvflow.lazy)
    __getattr__ = lazy_exports(__name__, {".base": ("AttentionBackend",)})

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend"]

ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry("attention backend")
ATTENTION_BACKENDS.register("torch", "kvflow.runtime.attention.torch_backend:TorchBackend")
ATTENTION_BACKENDS.register("cpu", "kvflow.runtime.attention.cpu_backend:CpuKernelBackend")
ATTENTION_BACKENDS.register("triton", "kvflow.runtime.attention.triton_backend:TritonBackend")
