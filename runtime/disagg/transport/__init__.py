"""KV transports behind one contract, chosen by name from a registry, with their options."""

from kvflow.runtime.disagg.transport.base import KVTransport, TransferError
from kvflow.runtime.disagg.transport.options import KVTransferOptions
from kvflow.runtime.disagg.transport.registry import KV_TRANSPORTS

__all__ = ["KV_TRANSPORTS", "KVTransferOptions", "KVTransport", "TransferError"]
