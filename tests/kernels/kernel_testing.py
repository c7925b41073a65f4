"""Shared pieces of the kernel tests: run mode, tolerances and paged KV layouts."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.kernels._launch import is_interpreted
from kvflow.kernels.decode_attention import _decode_partial_kernel

# Fixed at import of kvflow.kernels: TRITON_INTERPRET=1 then means CPU tensors, interpreted.
INTERPRETED = is_interpreted(_decode_partial_kernel)

# bf16 keeps 8 mantissa bits; attention also rounds probabilities to it before P @ V.
ATTENTION_TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def device_for(marker: str) -> str:
    """Tensor device of a test path: ``cuda`` for gpu tests, ``cpu`` under the interpreter."""
    return "cuda" if marker == "gpu" else "cpu"


def paged_slots(
    lengths: Sequence[int], page_size: int, num_slots: int, generator: torch.Generator
) -> torch.Tensor:
    """Token slots (int32) for requests of ``lengths`` tokens, laid out like a paged pool:
    each request owns whole pages drawn at random (non-contiguous, shuffled) from the pool."""
    pages_needed = [-(-length // page_size) for length in lengths]
    if sum(pages_needed) * page_size > num_slots:
        raise ValueError("pool too small for the requested lengths")
    pages = torch.randperm(num_slots // page_size, generator=generator)
    slots, next_page = [], 0
    for length, count in zip(lengths, pages_needed, strict=True):
        owned = pages[next_page : next_page + count]
        next_page += count
        offsets = torch.arange(page_size)
        slots.append((owned[:, None] * page_size + offsets[None, :]).flatten()[:length])
    return torch.cat(slots).to(torch.int32) if slots else torch.zeros(0, dtype=torch.int32)


def indptr(lengths: Sequence[int]) -> torch.Tensor:
    """CSR offsets [len(lengths) + 1] (int32) of consecutive runs of ``lengths``."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)
    return offsets
