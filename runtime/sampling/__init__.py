"""Per-request sampling parameters and the batched sampler."""

from kvflow.runtime.sampling.params import SamplingParams
from kvflow.runtime.sampling.sampler import PendingSample, SampleOutput, Sampler, SamplingBatch

__all__ = ["PendingSample", "SampleOutput", "Sampler", "SamplingBatch", "SamplingParams"]
