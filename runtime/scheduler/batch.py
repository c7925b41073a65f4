"""Builds a step's ForwardBatch from the requests it runs (KV slots already allocated)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.runtime.core import Req
from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode
from kvflow.runtime.host_copy import host_to_device

__all__ = ["build_decode_batch", "build_extend_batch"]


def build_extend_batch(
    reqs: Sequence[Req],
    extend_lens: Sequence[int],
    out_cache_loc: torch.Tensor,
    device: str,
    logit_extras: Sequence[int] = (),
) -> ForwardBatch:
    """Prefill step: request i runs tokens ``kv_len : kv_len + extend_lens[i]``; it needs
    the logits of its ``logit_extras[i]`` tokens before the last one too (prompt logprobs).
    The per-token and per-request integers travel to the device in one copy."""
    input_ids: list[int] = []
    positions: list[int] = []
    prefix_lens = [r.kv_len for r in reqs]
    for req, extend_len in zip(reqs, extend_lens, strict=True):
        input_ids += req.all_token_ids()[req.kv_len : req.kv_len + extend_len]
        positions += range(req.kv_len, req.kv_len + extend_len)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    # NOTE: one copy for the four (an eager prefill is bound by the host's calls)
    tokens, count = len(input_ids), len(reqs)
    flat = host_to_device(input_ids + positions + [r.req_pool_idx for r in reqs] + seq_lens, device)
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=flat[:tokens],
        positions=flat[tokens : 2 * tokens],
        out_cache_loc=out_cache_loc,
        req_pool_indices=flat[2 * tokens : 2 * tokens + count],
        seq_lens=flat[2 * tokens + count :],
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens,
        extend_seq_lens_cpu=list(extend_lens),
        extend_logit_extras_cpu=list(logit_extras),
        lora_paths=_lora_paths(reqs),
    )


def build_decode_batch(
    reqs: Sequence[Req],
    out_cache_loc: torch.Tensor,
    device: str,
    input_ids: torch.Tensor | None = None,
) -> ForwardBatch:
    """Decode step: each request feeds its last token at position ``kv_len``.

    ``input_ids`` (on ``device``) replaces the requests' last output tokens when the
    previous step's sampled ids are not on the host yet. The per-request integers travel
    to the device in one copy.
    """
    seq_lens = [r.kv_len + 1 for r in reqs]
    rows = [[r.kv_len for r in reqs], [r.req_pool_idx for r in reqs], seq_lens]
    if input_ids is None:
        rows.insert(0, [r.output_ids[-1] for r in reqs])
    on_device = host_to_device(rows, device)
    if input_ids is None:
        input_ids, on_device = on_device[0], on_device[1:]
    positions, req_pool_indices, seq_lens_dev = on_device
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens_dev,
        seq_lens_cpu=seq_lens,
        lora_paths=_lora_paths(reqs),
    )


def _lora_paths(reqs: Sequence[Req]) -> list[str | None]:
    """Each request's adapter; empty when none has one (the forward skips LoRA)."""
    paths = [r.lora_path for r in reqs]
    return paths if any(p is not None for p in paths) else []
