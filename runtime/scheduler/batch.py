"""Builds a step's ForwardBatch from the requests it runs (KV slots already allocated)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode
from kvflow.runtime.scheduler.req import Req

__all__ = ["build_decode_batch", "build_extend_batch"]


def build_extend_batch(
    reqs: Sequence[Req], extend_lens: Sequence[int], out_cache_loc: torch.Tensor, device: str
) -> ForwardBatch:
    """Prefill step: request i runs tokens ``kv_len : kv_len + extend_lens[i]``."""
    input_ids: list[int] = []
    positions: list[int] = []
    prefix_lens = [r.kv_len for r in reqs]
    for req, extend_len in zip(reqs, extend_lens, strict=True):
        input_ids += req.all_token_ids()[req.kv_len : req.kv_len + extend_len]
        positions += range(req.kv_len, req.kv_len + extend_len)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        out_cache_loc=out_cache_loc,
        req_pool_indices=torch.tensor(
            [r.req_pool_idx for r in reqs], dtype=torch.int64, device=device
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens,
        extend_seq_lens_cpu=list(extend_lens),
    )


def build_decode_batch(
    reqs: Sequence[Req], out_cache_loc: torch.Tensor, device: str
) -> ForwardBatch:
    """Decode step: each request feeds its last token at position ``kv_len``.

    The per-request integers travel to the device in one copy.
    """
    seq_lens = [r.kv_len + 1 for r in reqs]
    host = torch.tensor(
        [
            [r.output_ids[-1] for r in reqs],
            [r.kv_len for r in reqs],
            [r.req_pool_idx for r in reqs],
            seq_lens,
        ],
        dtype=torch.int64,
    )
    input_ids, positions, req_pool_indices, seq_lens_dev = host.to(device, non_blocking=True)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens_dev,
        seq_lens_cpu=seq_lens,
    )
