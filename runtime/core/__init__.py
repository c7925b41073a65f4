"""The ground floor: the types every layer of the engine shares (the cache, the sampler,
the scheduler and the PD roles all handle :class:`Req`). It imports only ``wire`` and the
detokenizer's text helpers, never a layer above it."""

from kvflow.runtime.core.req import Req, position_seed

__all__ = ["Req", "position_seed"]
