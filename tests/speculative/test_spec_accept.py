"""The acceptance rules and the NGRAM suffix match, on small vocabularies: the sampled rule
keeps the target's distribution (many seeded draws, a chi-square bound)."""

from __future__ import annotations

import torch

from kvflow.runtime.speculative.accept import accept_greedy, accept_sampled, target_probs
from kvflow.runtime.speculative.ngram import suffix_draft
from kvflow.runtime.wire import SamplingParams

DRAWS = 6000
# chi-square 0.999 quantiles: 4 and 2 degrees of freedom
CHI2_4, CHI2_2 = 18.47, 13.82


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _generators(seed: int):
    generator = torch.Generator()

    def at(j: int) -> torch.Generator:
        return generator.manual_seed(seed * 1000 + j)

    return at


def test_greedy_keeps_the_matching_prefix_and_one_target_token():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 9]) == ([4, 5, 6], 2)
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == ([4, 5, 6, 7], 3)
    assert accept_greedy([3], []) == ([3], 0)
    assert accept_greedy([1, 2], [2]) == ([1], 0)


def test_sampled_rule_keeps_the_target_distribution():
    p = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.1, 0.1, 0.2, 0.3]])
    q = torch.tensor([[0.5, 0.1, 0.1, 0.2, 0.1]])
    drafter = torch.Generator().manual_seed(11)
    for draft, draft_probs in (([1], None), ([0], None), ([4], None), (None, q)):
        first = torch.zeros(5)
        second = torch.zeros(5)  # the bonus token when the draft is kept
        kept = 0
        for seed in range(DRAWS):
            # a sampled draft: d ~ q (the rule's premise); else a point draft
            tokens = draft or [int(torch.multinomial(q[0], 1, generator=drafter)[0])]
            verdict = accept_sampled(p, tokens, _generators(seed), draft_probs)
            first[verdict.tokens[0]] += 1
            if verdict.num_accepted == 1:
                kept += 1
                second[verdict.tokens[1]] += 1
        assert _chi2(first, p[0]) < CHI2_4, (draft, first)
        if draft is not None:  # a point draft d is kept with probability p(d)
            rate = p[0, draft[0]].item()
            assert abs(kept / DRAWS - rate) < 4 * (rate * (1 - rate) / DRAWS) ** 0.5 + 1e-9
        if kept > 500:
            assert _chi2(second, p[1]) < CHI2_4, (draft, second)


def test_target_probs_follow_the_samplers_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = target_probs(logits, SamplingParams(temperature=0.5, top_k=2), 4)
    full = torch.softmax(logits / 0.5, dim=-1)[0]
    assert torch.allclose(probs[0, :2], full[:2] / full[:2].sum())
    assert probs[0, 2:].sum() == 0
    top_p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.5), 4)
    assert top_p[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    counts = torch.zeros(4)
    for seed in range(DRAWS):
        verdict = accept_sampled(probs, [], _generators(seed))
        counts[verdict.tokens[0]] += 1
    assert _chi2(counts[:2], probs[0, :2]) < CHI2_2


def test_suffix_draft_takes_what_followed_the_longest_latest_match():
    # (drafts: at most as many as the match is long)
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert suffix_draft(tokens, 3) == [4, 9, 2]  # "1 2 3" matched at the start
    assert suffix_draft([7, 8, 7, 8, 7, 8], 2) == [7, 8]
    assert suffix_draft([1, 2, 3, 4], 3) == []  # nothing repeats
    assert suffix_draft([1, 2, 1, 2], 0) == []
    assert suffix_draft([5, 1, 2, 6, 1, 2], 4) == [6, 1]  # no more drafts than matched
    assert suffix_draft([9, 5, 1, 2, 6, 9, 5, 1, 2], 8) == [6, 9, 5, 1]  # 4 matched
