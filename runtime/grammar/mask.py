"""Applying the grammars' token bitmasks to a batch's logits (CPU or CUDA)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.runtime.grammar.matcher import RequestGrammar

__all__ = ["apply_grammar_masks", "bitmask_words"]


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row (one bit per token)."""
    return (vocab_size + 31) // 32


def apply_grammar_masks(logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
    """Set to ``-inf`` the logits ``[B, V]`` (float32, in place) of tokens that row ``i``'s
    grammar forbids next; rows whose grammar is None are left as they are.

    The bitmask is filled on the host, for the constrained rows only, and applied with
    xgrammar's kernel (Triton on CUDA, C++ on CPU). Its rows cover all of ``V`` (the model's
    logits width), so ids past the tokenizer's vocabulary (padding) are masked too.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    import xgrammar as xgr

    on_cuda = logits.device.type == "cuda"
    bitmask = torch.full(
        (len(grammars), bitmask_words(logits.shape[-1])), -1, dtype=torch.int32, pin_memory=on_cuda
    )
    for row in rows:
        grammar = grammars[row]
        assert grammar is not None
        grammar.fill_mask(bitmask, row)
    device_mask = bitmask.to(logits.device, non_blocking=True) if on_cuda else bitmask
    xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=logits.shape[-1], indices=rows)
