"""Builds the forward batches of draft and verify steps: given tokens at given positions."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode

__all__ = ["build_token_batch"]


def build_token_batch(
    rows: Sequence[int],
    prefix_lens: Sequence[int],
    tokens: Sequence[Sequence[int]],
    out_cache_loc: torch.Tensor,
    device: str,
    all_logits: bool,
) -> ForwardBatch:
    """An extend batch: request i (row ``rows[i]`` of its ``req_to_token``, with KV for
    positions ``0:prefix_lens[i]``) runs ``tokens[i]`` at the positions after them, writing
    their KV to ``out_cache_loc`` (recorded in the rows already). ``all_logits``: the
    forward returns a logits row for every token (a verify step), else for each last one.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    for prefix_len, new in zip(prefix_lens, tokens, strict=True):
        input_ids += new
        positions += range(prefix_len, prefix_len + len(new))
    extend_lens = [len(new) for new in tokens]
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    ids, pos, pool, lens = (
        torch.tensor(v, dtype=torch.int64, device=device)
        for v in (input_ids, positions, list(rows), seq_lens)
    )
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=ids,
        positions=pos,
        out_cache_loc=out_cache_loc,
        req_pool_indices=pool,
        seq_lens=lens,
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens_cpu=extend_lens,
        extend_logit_extras_cpu=[n - 1 for n in extend_lens] if all_logits else [],
    )
