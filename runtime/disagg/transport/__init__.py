"""KV transports behind one contract, chosen by name from a registry."""

from kvflow.runtime.disagg.transport.base import KVTransport, TransferError
from kvflow.runtime.utils import Registry

__all__ = ["KV_TRANSPORTS", "KVTransport", "TransferError"]

KV_TRANSPORTS: Registry[KVTransport] = Registry("KV transport")
KV_TRANSPORTS.register("mooncake", "kvflow.runtime.disagg.transport.mooncake:MooncakeTransport")
