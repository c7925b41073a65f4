"""What a decode accepts from its prefill as a room's result, and the prompt fingerprint
its claims carry."""

from __future__ import annotations

import math

import pytest

from kvflow.runtime.wire.disagg import PrefillResult, prompt_hash

VOCAB = 49152
GOOD = {
    "first_token": 5,
    "logprob": -0.25,
    "top_logprobs": [[5, -0.25], [9, -2.0]],
    "cached_tokens": 3,
    "input_logprobs": [None, -1.5, -0.5],
    "input_top_logprobs": [None, [[7, -1.0]], [[3, -0.5], [4, -math.inf]]],
}


def test_a_result_round_trips() -> None:
    result = PrefillResult.from_json(GOOD, VOCAB)
    assert result.first_token == 5 and result.top_logprobs == ((5, -0.25), (9, -2.0))
    assert PrefillResult.from_json(result.to_json(), VOCAB) == result


@pytest.mark.parametrize(
    "body",
    [
        {"first_token": 0},
        {"first_token": VOCAB - 1, "unknown_field": {"x": 1}},  # extra fields are ignored
        {"first_token": 5, "logprob": -math.inf, "top_logprobs": None},
        {"first_token": 5, "input_logprobs": [], "input_top_logprobs": []},
    ],
)
def test_results_a_decode_accepts(body) -> None:
    assert PrefillResult.from_json(body, VOCAB).first_token == body["first_token"]


def test_no_first_token_only_for_a_request_that_wants_none() -> None:
    assert PrefillResult.from_json({}, VOCAB, wants_token=False).first_token is None
    assert PrefillResult.from_json({"first_token": None}, VOCAB, wants_token=False)
    with pytest.raises(ValueError, match="max_new_tokens 0"):
        PrefillResult.from_json({"first_token": 3}, VOCAB, wants_token=False)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (None, "not an object"),
        ([5], "not an object"),
        ("done", "not an object"),
        ({}, "no first_token"),
        ({"first_token": None}, "no first_token"),
        ({"first_token": -1}, "outside the vocabulary"),
        ({"first_token": VOCAB}, "outside the vocabulary"),
        ({"first_token": 1 << 70}, "outside the vocabulary"),
        ({"first_token": "5"}, "outside the vocabulary"),
        ({"first_token": 5.0}, "outside the vocabulary"),
        ({"first_token": True}, "outside the vocabulary"),
        ({"first_token": 5, "logprob": "x"}, "logprob must be a number"),
        ({"first_token": 5, "logprob": math.nan}, "logprob must be a logprob"),
        ({"first_token": 5, "logprob": math.inf}, "logprob must be a logprob"),
        ({"first_token": 5, "top_logprobs": [[-1, -0.5]]}, "outside the vocabulary"),
        ({"first_token": 5, "top_logprobs": [[VOCAB, -0.5]]}, "outside the vocabulary"),
        ({"first_token": 5, "top_logprobs": [[1]]}, "pairs"),
        ({"first_token": 5, "top_logprobs": [[1, None]]}, "pairs"),
        ({"first_token": 5, "top_logprobs": "x"}, "pairs"),
        ({"first_token": 5, "top_logprobs": {"1": -0.5}}, "pairs"),
        ({"first_token": 5, "cached_tokens": -1}, "cached_tokens"),
        ({"first_token": 5, "cached_tokens": "3"}, "cached_tokens"),
        ({"first_token": 5, "input_logprobs": "x"}, "input_logprobs must be a list"),
        ({"first_token": 5, "input_logprobs": [{"a": 1}]}, "input_logprobs must be a number"),
        ({"first_token": 5, "input_top_logprobs": [None]}, "without input_logprobs"),
        (
            {"first_token": 5, "input_logprobs": [None, -1.0], "input_top_logprobs": [None]},
            "one entry per input logprob",
        ),
        (
            {"first_token": 5, "input_logprobs": [-1.0], "input_top_logprobs": [[[-3, -1.0]]]},
            "outside the vocabulary",
        ),
    ],
)
def test_results_a_decode_refuses(body, why) -> None:
    with pytest.raises(ValueError, match=why):
        PrefillResult.from_json(body, VOCAB)


def test_the_prompt_hash_tells_prompts_of_one_length_apart() -> None:
    france, spain = [504, 3575, 282, 4649, 314], [504, 3575, 282, 8046, 314]
    assert prompt_hash(france) == prompt_hash(list(france))
    assert prompt_hash(france) != prompt_hash(spain)
    assert prompt_hash([1, 2]) != prompt_hash([2, 1]) != prompt_hash([1, 2, 0])
    assert len(prompt_hash(france)) == 32 and int(prompt_hash(france), 16) >= 0
