"""Acceptance of a draft against the target's logits: greedy and sampled rules."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvflow.runtime.sampling import filtered_out
from kvflow.runtime.speculative.tree import ROOT, DraftTree
from kvflow.runtime.wire import SamplingParams

__all__ = [
    "TreeVerdict",
    "Verdict",
    "accept_greedy",
    "accept_sampled",
    "accept_tree_greedy",
    "accept_tree_sampled",
    "target_probs",
]


class Verdict(NamedTuple):
    """What a verify step emits for one request."""

    tokens: list[int]  # the accepted drafts, then one token of the target's own
    num_accepted: int  # drafts accepted (len(tokens) - 1)


def accept_greedy(target_ids: Sequence[int], draft: Sequence[int]) -> Verdict:
    """``target_ids[j]``: the target's argmax after draft position j (``len(draft) + 1``
    of them). Drafts are kept while each equals the target's choice: the tokens are the
    ones plain greedy decoding would emit."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target_ids[accepted]:
        accepted += 1
    return Verdict(list(target_ids[: accepted + 1]), accepted)


def target_probs(logits: torch.Tensor, params: SamplingParams, vocab_size: int) -> torch.Tensor:
    """The distribution the sampler draws from for each row of ``logits`` ([R, V]):
    temperature, then top-k, top-p and min-p (the sampler's rule), renormalised."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1 or params.top_k > 0 or params.min_p > 0:
        rows, device = probs.shape[0], probs.device
        top_k = vocab_size if params.top_k < 1 else min(params.top_k, vocab_size)
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        drop = filtered_out(
            sorted_probs,
            torch.full((rows,), top_k, dtype=torch.int64, device=device),
            torch.full((rows,), params.top_p, dtype=torch.float32, device=device),
            torch.full((rows,), params.min_p, dtype=torch.float32, device=device),
        )
        probs = torch.zeros_like(probs).scatter_(1, sorted_ids, sorted_probs.masked_fill(drop, 0))
    return probs / probs.sum(dim=-1, keepdim=True)


def accept_sampled(
    probs: torch.Tensor,
    draft: Sequence[int],
    generator_at: Callable[[int], torch.Generator | None],
    draft_probs: torch.Tensor | None = None,
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft token j is
    kept with probability ``min(1, p_j(d) / q_j(d))``; the first one refused is replaced
    by a draw from ``norm(max(p_j - q_j, 0))``; when all are kept, one more token is drawn
    from ``p_k``. Every emitted token is then distributed exactly as the target's ``p``.

    ``probs``: the target's distributions ``[k + 1, V]``; ``draft_probs``: the draft's
    ``[k, V]`` (None: point drafts, ``q_j = one-hot(d_j)``); ``generator_at(j)``: the
    generator for the j-th emitted token (seeded per output position).
    """
    tokens: list[int] = []
    for j, token in enumerate(draft):
        generator = generator_at(j)
        p = probs[j]
        q_token = 1.0 if draft_probs is None else float(draft_probs[j, token])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * q_token < float(p[token]):
            tokens.append(token)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0
        else:
            residual = (p - draft_probs[j]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q: nothing is left to correct
            residual = p
        tokens.append(int(torch.multinomial(residual, 1, generator=generator)[0]))
        return Verdict(tokens, j)
    last = probs[len(draft)]
    tokens.append(int(torch.multinomial(last, 1, generator=generator_at(len(draft)))[0]))
    return Verdict(tokens, len(draft))


class TreeVerdict(NamedTuple):
    """What a verify step of a draft tree emits for one request."""

    tokens: list[int]  # the accepted path's drafts, then one token of the target's own
    path: list[int]  # the accepted nodes, root's child first (len(tokens) - 1 of them)


def accept_tree_greedy(target_ids: Sequence[int], tree: DraftTree) -> TreeVerdict:
    """``target_ids[0]``: the target's argmax after the root; ``target_ids[1 + j]``: after
    node j. From the root, the child whose token is the target's choice is taken while
    there is one (children's tokens differ): the tokens plain greedy decoding emits."""
    path: list[int] = []
    node, choice = ROOT, target_ids[0]
    while True:
        match = [c for c in tree.children(node) if tree.tokens[c] == choice]
        if not match:
            return TreeVerdict([*(tree.tokens[j] for j in path), choice], path)
        node = match[0]
        path.append(node)
        choice = target_ids[1 + node]


def accept_tree_sampled(
    probs: torch.Tensor,
    tree: DraftTree,
    generator_at: Callable[[int], torch.Generator | None],
) -> TreeVerdict:
    """SGLang's target-only tree rule (its thresholds at 1): at a node with children
    ``c_1..c_m`` (distinct tokens), one draw ``u`` keeps ``c_i`` when ``u`` falls in
    ``[sum_{l<i} p(c_l), sum_{l<=i} p(c_l))``; when none is kept, a token is drawn from
    ``p`` without the children's tokens, renormalised; at a leaf, from ``p``. Each emitted
    token is distributed exactly as the target's ``p`` (a chain: :func:`accept_sampled`
    with point drafts, draw for draw).

    ``probs``: ``[1 + len(tree), V]``, the root's row first, then node j's at ``1 + j``;
    ``generator_at(j)``: the generator for the j-th emitted token.
    """
    path: list[int] = []
    node = ROOT
    while True:
        generator = generator_at(len(path))
        p = probs[1 + node]
        children = tree.children(node)
        if not children:
            token = int(torch.multinomial(p, 1, generator=generator)[0])
            return TreeVerdict([*(tree.tokens[j] for j in path), token], path)
        u = float(torch.rand((), generator=generator, device=p.device))
        total = 0.0
        kept = None
        for child in children:
            total += float(p[tree.tokens[child]])
            if u < total:
                kept = child
                break
        if kept is None:
            residual = p.clone()
            residual[[tree.tokens[c] for c in children]] = 0
            if float(residual.sum()) <= 0:  # the children hold all of p (rounding)
                residual = p
            token = int(torch.multinomial(residual, 1, generator=generator)[0])
            return TreeVerdict([*(tree.tokens[j] for j in path), token], path)
        node = kept
        path.append(node)
