"""Prefill/decode disaggregation. Exported here: the KV transport layer.

A :class:`KVLayout` describes a KV pool for a peer; :func:`transfer_plan` turns slot lists
into byte-range writes; a :class:`KVTransport` (from :data:`KV_TRANSPORTS`) performs them.
"""

from kvflow.runtime.disagg.layout import KVLayout, Region, layout_of, model_fingerprint
from kvflow.runtime.disagg.plan import Write, transfer_plan
from kvflow.runtime.disagg.transport import KV_TRANSPORTS, KVTransport, TransferError

__all__ = [
    "KV_TRANSPORTS",
    "KVLayout",
    "KVTransport",
    "Region",
    "TransferError",
    "Write",
    "layout_of",
    "model_fingerprint",
    "transfer_plan",
]
