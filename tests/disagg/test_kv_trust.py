"""Where KV may go and what a decode's slots hold before it arrives: the prefill writes a
room's KV only to a claim for the same prompt, within the claimer's pool; the decode
zeroes the slots it reserved before it claims."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import kv_pool, model_config

from kvflow.runtime.disagg import layout_of
from kvflow.runtime.disagg.prefill import _claim_problem
from kvflow.runtime.disagg.ranks import Endpoint
from kvflow.runtime.disagg.rooms import Claim
from kvflow.runtime.wire.disagg import prompt_hash

FRANCE = [504, 3575, 282, 4649, 314]
SPAIN = [504, 3575, 282, 8046, 314]


@pytest.fixture(scope="module")
def peer():
    """A registered decode of one rank."""
    config = model_config()
    return (Endpoint("d:1", layout_of(kv_pool(config, num_slots=16), config, page_size=1)),)


def test_a_claim_for_the_same_prompt_is_written(peer) -> None:
    assert _claim_problem(FRANCE, Claim("d:1", (3, 4, 5, 6, 7), prompt_hash(FRANCE)), peer) is None


@pytest.mark.parametrize(
    ("slots", "prompt", "why"),
    [
        ((3, 4, 5, 6, 7), SPAIN, "not this room's prompt"),
        ((3, 4, 5, 6), FRANCE, "claimed 4 slots for a 5-token prompt"),
        ((3, 4, 5, 6, 16), FRANCE, "outside its pool of 16"),
    ],
)
def test_other_claims_fail_the_room(peer, slots, prompt, why) -> None:
    problem = _claim_problem(FRANCE, Claim("d:1", slots, prompt_hash(prompt)), peer)
    assert problem is not None and why in problem
    assert "not registered" in str(_claim_problem(FRANCE, Claim("d:1", slots, "x"), None))


def test_every_rank_of_the_decode_must_hold_the_slots(peer) -> None:
    """Under tensor parallelism the claim's slots are each rank's: the smallest pool bounds."""
    config = model_config()
    small = Endpoint("d:2", layout_of(kv_pool(config, num_slots=6), config, page_size=1))
    claim = Claim("d:1", (3, 4, 5, 6, 7), prompt_hash(FRANCE))
    assert "outside its pool of 6" in str(_claim_problem(FRANCE, claim, (*peer, small)))


@pytest.mark.parametrize(
    "slots",
    [
        [1, 2, 6],  # runs of consecutive slots (a slice each on CPU)
        [9, 3, 4, 5],  # not in order
        list(range(0, 200, 2)),  # scattered: more runs than a slice each is worth
        [],
    ],
)
def test_zero_slots_clears_k_and_v_of_every_layer_there_only(slots) -> None:
    pool = kv_pool(model_config(), num_slots=200)
    for buffer in pool.k_buffer + pool.v_buffer:
        buffer.normal_()
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    pool.zero_slots(torch.tensor(slots, dtype=torch.int64))
    kept = [slot for slot in range(200) if slot not in slots]
    for old, new in zip(before, pool.k_buffer + pool.v_buffer, strict=True):
        assert not new[slots].any()
        assert torch.equal(new[kept], old[kept])
