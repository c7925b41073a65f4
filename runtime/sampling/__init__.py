"""Per-request sampling parameters and the batched sampler."""

from kvflow.runtime.sampling.sampler import (
    PendingSample,
    SampleOutput,
    Sampler,
    SamplingBatch,
    filtered_out,
    needs_adjust,
)
from kvflow.runtime.wire import SamplingParams

__all__ = [
    "PendingSample",
    "SampleOutput",
    "Sampler",
    "SamplingBatch",
    "SamplingParams",
    "filtered_out",
    "needs_adjust",
]
