"""Builds the forward batches of draft and verify steps: given tokens at given positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode

__all__ = ["build_decode_batch", "build_token_batch"]


class _Tokens(NamedTuple):
    """Every request's new tokens, flattened request by request: their ids and positions
    (after each request's prefix), and which request each belongs to."""

    input_ids: list[int]
    positions: list[int]
    owners: list[int]

    @classmethod
    def of(cls, prefix_lens: Sequence[int], tokens: Sequence[Sequence[int]]) -> _Tokens:
        flat = cls([], [], [])
        for i, (prefix_len, new) in enumerate(zip(prefix_lens, tokens, strict=True)):
            flat.input_ids.extend(new)
            flat.positions.extend(range(prefix_len, prefix_len + len(new)))
            flat.owners.extend([i] * len(new))
        return flat


def _on(device: str, *rows: list[int]) -> list[torch.Tensor]:
    return [torch.tensor(row, dtype=torch.int64, device=device) for row in rows]


def build_token_batch(
    rows: Sequence[int],
    prefix_lens: Sequence[int],
    tokens: Sequence[Sequence[int]],
    out_cache_loc: torch.Tensor,
    device: str,
) -> ForwardBatch:
    """An extend batch: request i (row ``rows[i]`` of its ``req_to_token``, with KV for
    positions ``0:prefix_lens[i]``) runs ``tokens[i]`` at the positions after them, writing
    their KV to ``out_cache_loc`` (recorded in the rows already); the forward returns each
    request's last logits row (a draft step)."""
    flat = _Tokens.of(prefix_lens, tokens)
    extend_lens = [len(new) for new in tokens]
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    ids, pos, pool, lens = _on(device, flat.input_ids, flat.positions, list(rows), seq_lens)
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
    )


def build_decode_batch(
    pool_rows: Sequence[int],
    positions: Sequence[int],
    input_ids: Sequence[int],
    out_cache_loc: torch.Tensor,
    device: str,
) -> ForwardBatch:
    """A decode batch of one row per token: token ``input_ids[r]`` at ``positions[r]``
    (its KV written to ``out_cache_loc[r]``, recorded in row ``pool_rows[r]`` of
    ``req_to_token`` already) attends to the ``positions[r] + 1`` positions of that row, up
    to and including its own. One logits row per token, in the order given.

    The verify step scores its tokens this way. A decode step stores every row's K/V
    before any row attends, so a row sees the drafted tokens its ``req_to_token`` row
    holds before it: a chain's tokens share the request's row (the causal attention of an
    extend over the drafted positions), a tree node's row holds its ancestors
    (:mod:`kvflow.runtime.speculative.tree_rows`). A draft model's steps after its first
    run one token per request, each in its own row. As decode batches they replay the
    runner's decode CUDA graphs (padded to a captured row count) and run the decode
    kernels plain decoding runs.
    """
    seq_lens = [p + 1 for p in positions]
    ids, pos, pool, lens = _on(device, list(input_ids), list(positions), list(pool_rows), seq_lens)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=ids,
        positions=pos,
        out_cache_loc=out_cache_loc,
        req_pool_indices=pool,
        seq_lens=lens,
        seq_lens_cpu=seq_lens,
    )
