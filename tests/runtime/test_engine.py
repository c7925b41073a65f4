"""The offline Engine API: finish reasons, stop handling, n > 1, seeds, logprobs, aborts, errors."""

from __future__ import annotations

import pytest

from kvflow.runtime.sampling import SamplingParams
from kvflow.runtime.scheduler import Req
from kvflow.runtime.wire import GenerateRequest

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_answer_and_finish_on_eos(engine):
    result = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 32})
    assert result.text == "The capital of France is Paris."
    assert result.finish_reason.type == "stop" and result.finish_reason.matched == 2
    assert result.usage.prompt_tokens == len(engine.encode(PROMPT))
    assert result.usage.completion_tokens == len(result.output_ids)


def test_length_finish(engine):
    result = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 3})
    assert result.finish_reason.type == "length" and len(result.output_ids) == 3


def test_stop_string_trimmed(engine):
    result = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 32, "stop": [" is"]})
    assert result.text == "The capital of France"
    assert result.finish_reason.matched == " is"


def test_stop_token_ids_and_ignore_eos(engine):
    paris = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 32})
    first = paris.output_ids[0]
    stopped = engine.generate(PROMPT, {"temperature": 0, "stop_token_ids": [first]})
    assert stopped.output_ids == [first] and stopped.finish_reason.matched == first
    forced = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    assert len(forced.output_ids) == 12 and forced.finish_reason.type == "length"


def test_min_new_tokens_delays_the_stop(engine):
    result = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 20, "min_new_tokens": 12})
    assert len(result.output_ids) >= 12


def test_seed_reproducible_and_n_shares_the_prefix(engine):
    params = {"temperature": 1.0, "max_new_tokens": 16, "seed": 42}
    first = engine.generate(PROMPT, params)
    second = engine.generate(PROMPT, params)
    assert first.output_ids == second.output_ids
    several = engine.generate(PROMPT, {**params, "n": 3})
    assert len(several) == 3
    assert several[0].output_ids == first.output_ids  # sample i uses seed + i
    assert len({tuple(r.output_ids) for r in several}) > 1
    assert all(r.cached_tokens >= len(engine.encode(PROMPT)) - 1 for r in several)


def test_logprobs(engine):
    result = engine.generate(
        PROMPT, {"temperature": 0, "max_new_tokens": 4}, return_logprob=True, top_logprobs_num=2
    )
    assert len(result.logprobs) == 4 and all(lp <= 0 for lp in result.logprobs)
    assert all(
        top[0][0] == tok for top, tok in zip(result.top_logprobs, result.output_ids, strict=True)
    )


def test_extra_key_isolates_the_cache(engine):
    engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 2}, extra_key="salt-a")
    other = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 2}, extra_key="salt-b")
    same = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 2}, extra_key="salt-a")
    assert other.cached_tokens == 0
    assert same.cached_tokens > 0


def test_batch_with_per_prompt_params(engine):
    results = engine.generate(
        [PROMPT, "Hello"],
        [{"temperature": 0, "max_new_tokens": 2}, {"temperature": 0, "max_new_tokens": 5}],
    )
    assert [len(r.output_ids) for r in results] == [2, 5]


def test_abort_waiting_and_running_requests_releases_memory(engine):
    sched = engine.scheduler
    ids = engine.encode(PROMPT)
    reqs = [
        Req(
            GenerateRequest(
                rid=f"abort-{i}",
                input_ids=ids,
                sampling=SamplingParams(temperature=0, max_new_tokens=50),
            )
        )
        for i in range(3)
    ]
    for r in reqs:
        sched.add_request(r)
    sched.step()  # prefill: all three running
    sched.step()  # one decode step
    assert sched.abort_request("abort-0").finish_reason.type == "abort"
    late = Req(
        GenerateRequest(rid="abort-late", input_ids=ids, sampling=SamplingParams(max_new_tokens=5))
    )
    sched.add_request(late)
    assert sched.abort_request("abort-late").finish_reason.type == "abort"  # still waiting
    while sched.has_work():
        sched.step()
    assert reqs[1].finished and reqs[2].finished
    assert sched.abort_request("unknown") is None


def test_too_long_and_invalid_inputs_are_refused(engine):
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=[1] * 100, sampling_params={"max_new_tokens": 10**6})
    with pytest.raises(ValueError, match="input token ids"):
        engine.generate(input_ids=[10**7])
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[[]])
    with pytest.raises(ValueError):
        engine.generate(PROMPT, {"temperature": -1})


def test_max_new_tokens_zero_only_prefills(engine):
    result = engine.generate(PROMPT, {"max_new_tokens": 0})
    assert result.output_ids == [] and result.finish_reason.type == "length"
