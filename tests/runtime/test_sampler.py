"""The sampler: each parameter changes what it should; seeded sampling is reproducible."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.runtime.sampling import Sampler, SamplingBatch, SamplingParams
from kvflow.runtime.scheduler import Req
from kvflow.runtime.wire import GenerateRequest

VOCAB = 8


def req(rid: str = "r", prompt=(0,), output=(), **params) -> Req:
    r = Req(
        GenerateRequest(rid=rid, input_ids=list(prompt), sampling=SamplingParams(**params)),
        eos_token_ids=(7,),
        seed=1234,
    )
    r.output_ids = list(output)
    return r


def sample(reqs, logits, vocab=VOCAB):
    batch = SamplingBatch.from_reqs(reqs, vocab, "cpu")
    return Sampler(vocab, "cpu").sample(logits.clone(), batch)


def run(reqs, logits, steps: int, row: int = 0) -> list[int]:
    """Sample ``steps`` tokens for ``reqs[row]`` (each step's tokens appended, as the
    scheduler does: a seeded request draws token i from (seed, i))."""
    picked = []
    for _ in range(steps):
        ids = sample(reqs, logits).next_token_ids
        for r, token in zip(reqs, ids, strict=True):
            r.output_ids.append(token)
        picked.append(ids[row])
    return picked


def draws(logits_row, n=400, **params) -> list[int]:
    return run([req(seed=7, **params)], logits_row[None, :], n)


LOGITS = torch.tensor([1.0, 2.0, 3.0, 0.5, 0.0, -1.0, 2.5, -2.0])


def test_greedy_picks_argmax_per_row():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    out = sample([req("a", temperature=0), req("b", temperature=0)], logits)
    assert out.next_token_ids == [2, 5]


def test_top_k_one_is_greedy_even_with_temperature():
    assert set(draws(LOGITS, n=50, temperature=1.5, top_k=1)) == {2}


def test_temperature_spreads_the_choices():
    cold = draws(LOGITS, temperature=0.05)
    hot = draws(LOGITS, temperature=5.0)
    assert set(cold) == {2}
    assert len(set(hot)) >= 6


def test_top_k_restricts_the_support():
    assert set(draws(LOGITS, temperature=5.0, top_k=3)) == {2, 6, 1}


def test_top_p_keeps_the_smallest_head_reaching_p():
    probs = torch.softmax(LOGITS, 0)
    order = probs.argsort(descending=True).tolist()
    # keep tokens until cumulative mass reaches 0.6
    head, mass = [], 0.0
    for t in order:
        head.append(t)
        mass += float(probs[t])
        if mass >= 0.6:
            break
    assert set(draws(LOGITS, temperature=1.0, top_p=0.6)) == set(head)


def test_min_p_drops_unlikely_tokens():
    probs = torch.softmax(LOGITS, 0)
    allowed = {i for i in range(VOCAB) if probs[i] >= 0.3 * probs.max()}
    assert set(draws(LOGITS, temperature=1.0, min_p=0.3)) == allowed


def test_same_seed_same_sequence_different_seed_differs():
    a = draws(LOGITS, n=50, temperature=3.0)
    b = draws(LOGITS, n=50, temperature=3.0)
    assert a == b  # draws() seeds each request with 7
    r1, r2 = req("x", temperature=3.0, seed=1), req("y", temperature=3.0, seed=2)
    assert run([r1], LOGITS[None], 50) != run([r2], LOGITS[None], 50)


def test_seeded_draw_depends_on_the_position_not_on_the_history():
    """Token i is drawn from (seed, i): a second process that continues a request from
    position i (a PD decode after its prefill drew token 0) draws what one process would."""
    whole = run([req("a", temperature=3.0, seed=11)], LOGITS[None], 20)
    resumed = req("b", temperature=3.0, seed=11, output=whole[:5])
    assert run([resumed], LOGITS[None], 15) == whole[5:]
    assert len(set(whole)) > 3  # still a random sequence


def test_seeded_row_ignores_its_batch_neighbours():
    alone = req("a", temperature=2.0, seed=99)
    first = run([alone], LOGITS[None], 30)
    batched = req("b", temperature=2.0, seed=99)
    other = req("c", temperature=2.0, seed=5)
    assert run([other, batched], LOGITS.expand(2, -1).contiguous(), 30, row=1) == first


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    assert sample([req(temperature=0, prompt=[0])], logits).next_token_ids == [0]
    assert sample(
        [req(temperature=0, prompt=[0], repetition_penalty=1.5)], logits
    ).next_token_ids == [1]


def test_frequency_and_presence_penalties_use_output_counts():
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    once = dict(temperature=0, output=[0])
    assert sample([req(**once)], logits).next_token_ids == [0]
    assert sample([req(presence_penalty=1.0, **once)], logits).next_token_ids == [1]
    assert sample(
        [req(temperature=0, output=[0, 0], frequency_penalty=0.3)], logits
    ).next_token_ids == [1]
    assert sample(
        [req(temperature=0, output=[0], frequency_penalty=0.3)], logits
    ).next_token_ids == [0]


def test_min_new_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 9.0]])  # 7 is EOS
    assert sample([req(temperature=0)], logits).next_token_ids == [7]
    assert sample([req(temperature=0, min_new_tokens=2)], logits).next_token_ids == [3]
    stopped = req(temperature=0, min_new_tokens=2, stop_token_ids=(3,))
    assert sample([stopped], logits).next_token_ids == [0]


def test_ignore_eos_does_not_mask_but_does_not_stop():
    r = req(temperature=0, ignore_eos=True, max_new_tokens=3)
    r.append_token(7, context_len=100)
    assert not r.finished


def test_logprobs_and_top_logprobs():
    r = req(temperature=0)
    r.return_logprob, r.top_logprobs_num = True, 3
    out = sample([r], LOGITS[None])
    expected = torch.log_softmax(LOGITS, 0)
    assert math.isclose(out.logprobs[0], float(expected[2]), rel_tol=1e-5)
    assert [t for t, _ in out.top_logprobs[0]] == [2, 6, 1]


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": 0},
        {"min_p": 2},
        {"max_new_tokens": -1},
        {"frequency_penalty": 3},
        {"n": 0},
        {"stop": [""]},
        {"bogus": 1},
        {"temperature": "hot"},
        {"max_new_tokens": True},
    ],
)
def test_invalid_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams.from_dict(bad)
