"""Attention backends behind one interface, chosen by name from a registry."""

from kvflow.runtime.attention.base import AttentionBackend
from kvflow.runtime.utils import Registry

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend"]

ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry("attention backend")
ATTENTION_BACKENDS.register("torch", "kvflow.runtime.attention.torch_backend:TorchBackend")
ATTENTION_BACKENDS.register("cpu", "kvflow.runtime.attention.cpu_backend:CpuKernelBackend")
ATTENTION_BACKENDS.register("triton", "kvflow.runtime.attention.triton_backend:TritonBackend")
