"""The registry of KV transports, by the name SGLang's ``--disaggregation-transfer-backend``
gives them (imported on use: a transport loads native libraries)."""

from kvflow.runtime.disagg.transport.base import KVTransport
from kvflow.runtime.utils import Registry

__all__ = ["KV_TRANSPORTS"]

KV_TRANSPORTS: Registry[KVTransport] = Registry("KV transport")
KV_TRANSPORTS.register("mooncake", "kvflow.runtime.disagg.transport.mooncake:MooncakeTransport")
KV_TRANSPORTS.register("cuda_ipc", "kvflow.runtime.disagg.transport.cuda_ipc:CudaIpcTransport")
