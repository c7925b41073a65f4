"""Small host lists onto the device without making the host wait for the GPU."""

from __future__ import annotations

import torch

__all__ = ["host_to_device"]


def host_to_device(
    rows: list[list[int]] | list[int], device: str, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """``rows`` as a ``dtype`` tensor on ``device``, the copy queued behind the stream's work.

    A copy from pageable memory may wait for the stream's queued work (the driver stages
    it): the host stops launching until the GPU drains. From pinned memory it is queued
    behind that work, and torch's pinned-block cache keeps the block until the copy has run.
    """
    on_cuda = device.startswith("cuda")
    host = torch.tensor(rows, dtype=dtype, pin_memory=on_cuda)
    return host.to(device, non_blocking=True) if on_cuda else host.to(device)
