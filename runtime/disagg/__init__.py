"""Prefill/decode disaggregation. Exported here: the KV transport layer.

A :class:`KVLayout` describes a KV pool for a peer; :func:`slot_plan` turns slot lists into
runs of slots (:class:`SlotPlan`) and :func:`transfer_plan` into byte-range writes; a
:class:`KVTransport` (from :data:`KV_TRANSPORTS`) performs them.
"""

from kvflow.runtime.disagg.layout import (
    FeatureBuffer,
    KVLayout,
    Region,
    layout_of,
    model_fingerprint,
)
from kvflow.runtime.disagg.plan import SlotPlan, Write, slot_plan, transfer_plan
from kvflow.runtime.disagg.transport import KV_TRANSPORTS, KVTransport, TransferError

__all__ = [
    "KV_TRANSPORTS",
    "FeatureBuffer",
    "KVLayout",
    "KVTransport",
    "Region",
    "SlotPlan",
    "TransferError",
    "Write",
    "layout_of",
    "model_fingerprint",
    "slot_plan",
    "transfer_plan",
]
