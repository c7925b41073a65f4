"""NGRAM drafting: the tokens that followed the latest earlier occurrence of the request's
own suffix (its prompt and output), no extra model."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.runtime.core import Req
from kvflow.runtime.speculative.base import Drafter

__all__ = ["NgramDrafter", "suffix_draft"]

# Suffix lengths tried, longest first (SGLang's --speculative-ngram-{min,max}-match-window-size
# defaults are 1 and 12; a one-token match drafts too often on text that does not repeat).
MIN_MATCH = 2
MAX_MATCH = 12


def suffix_draft(tokens: Sequence[int], max_drafts: int, min_match: int = MIN_MATCH) -> list[int]:
    """The tokens that followed the earlier occurrence of ``tokens``' suffix with the longest
    match (at least ``min_match`` tokens, at most ``MAX_MATCH``; the latest occurrence on
    ties), as many as matched but at most ``max_drafts``; empty when none matches."""
    end = len(tokens)
    if max_drafts <= 0 or end < min_match + 1:
        return []
    last = tokens[-1]
    best_len, best_at = 0, -1
    # candidate j: tokens[j] == last with j < end - 1; its match runs backwards from there
    for j in range(end - 2, -1, -1):
        if tokens[j] != last:
            continue
        length = 1
        while (
            length < MAX_MATCH
            and j - length >= 0
            and tokens[j - length] == tokens[end - 1 - length]
        ):
            length += 1
        if length > best_len:
            best_len, best_at = length, j
            if length == MAX_MATCH:
                break
    if best_len < min_match:
        return []
    # NOTE: no more drafts than matched tokens: a short match (common in text that does not
    # repeat) rarely runs on for long, and every refused draft costs a row of the verify
    # forward (on 2 CPU cores 8 rows cost 1.45x one row, the embedded model at 300 tokens).
    return list(tokens[best_at + 1 : best_at + 1 + min(max_drafts, best_len)])


class NgramDrafter(Drafter):
    """Drafts by suffix match over each request's own tokens (stateless)."""

    def __init__(self, min_match: int = MIN_MATCH) -> None:
        self.min_match = min_match

    def propose(self, reqs: Sequence[Req], max_drafts: Sequence[int]) -> list[list[int]]:
        return [
            suffix_draft(req.all_token_ids(), limit, self.min_match) if limit > 0 else []
            for req, limit in zip(reqs, max_drafts, strict=True)
        ]


def make_ngram_drafter(config: object, target: object) -> NgramDrafter:
    """The registry's factory (NGRAM needs neither the config's sizes nor the target)."""
    return NgramDrafter()
