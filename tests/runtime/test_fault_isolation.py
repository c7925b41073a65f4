"""A request whose processing raises ends with an error; the scheduler and every other
request go on, and no KV memory is lost (issue: one request must never kill the server)."""

from __future__ import annotations

import dataclasses

import pytest

from kvflow.runtime.scheduler import Req
from kvflow.runtime.wire import GenerateRequest, SamplingParams

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def _drain(sched) -> dict:
    finished = {}
    while sched.has_work():
        for out in sched.step():
            if out.finish_reason is not None:
                finished[out.rid] = out
    return finished


def test_a_failing_decode_step_aborts_its_batch_and_frees_its_kv(engine, monkeypatch):
    sched, runner = engine.scheduler, engine.runner
    ids = engine.encode(PROMPT)
    reqs = [
        Req(
            GenerateRequest(
                rid=f"fail-{i}",
                input_ids=ids,
                sampling=SamplingParams(temperature=0, max_new_tokens=20),
            )
        )
        for i in (0, 1)
    ]
    for req in reqs:
        sched.add_request(req)
    sched.step()  # prefill: both running
    real_forward = runner.forward
    calls = {"n": 0}

    def broken_forward(fb):
        calls["n"] += 1
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(runner, "forward", broken_forward)
    sched._drop_next()  # a step built ahead would not call forward again
    outs = sched.step()
    monkeypatch.setattr(runner, "forward", real_forward)
    assert calls["n"] == 1
    assert {o.rid for o in outs} == {"fail-0", "fail-1"}
    for out in outs:
        assert out.finish_reason.type == "abort"
        assert "injected device fault" in out.finish_reason.message
    assert not sched.has_work()
    assert sched.kv.is_fully_free()
    # the scheduler goes on serving
    result = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 32})
    assert result.text == "The capital of France is Paris."


def test_a_failing_prefill_aborts_only_the_new_requests(engine, monkeypatch):
    sched, runner = engine.scheduler, engine.runner
    ids = engine.encode(PROMPT)
    steady = Req(
        GenerateRequest(
            rid="steady", input_ids=ids, sampling=SamplingParams(temperature=0, max_new_tokens=12)
        )
    )
    sched.add_request(steady)
    sched.step()  # steady is running
    real_forward = runner.forward

    def broken_extend(fb):
        if not fb.is_decode:
            raise ValueError("injected prefill fault")
        return real_forward(fb)

    monkeypatch.setattr(runner, "forward", broken_extend)
    late = Req(
        GenerateRequest(
            rid="late",
            input_ids=[*ids, 42],
            sampling=SamplingParams(temperature=0, max_new_tokens=5),
        )
    )
    sched.add_request(late)
    finished = _drain(sched)
    monkeypatch.setattr(runner, "forward", real_forward)
    assert finished["late"].finish_reason.type == "abort"
    assert "injected prefill fault" in finished["late"].finish_reason.message
    assert finished["steady"].finish_reason.type in ("stop", "length")
    assert sched.kv.is_fully_free()


def test_a_request_failing_while_admitted_ends_alone_instead_of_blocking_the_queue(
    engine, monkeypatch
):
    """An error while a waiting request is matched or admitted (a tier's load-back, say)
    ends that request: it must not stay first in the queue, failing the same way on
    every step while its client waits forever, nor keep the row it was given."""
    sched = engine.scheduler
    ids = engine.encode(PROMPT)
    steady = Req(
        GenerateRequest(
            rid="steady", input_ids=ids, sampling=SamplingParams(temperature=0, max_new_tokens=12)
        )
    )
    sched.add_request(steady)
    sched.step()  # steady is running
    real_load_back = sched.cache.load_back
    calls = {"n": 0}

    def broken_load_back(match):
        calls["n"] += 1
        raise RuntimeError("injected load-back fault")

    monkeypatch.setattr(sched.cache, "load_back", broken_load_back)
    late = Req(
        GenerateRequest(
            rid="late",
            input_ids=[*ids, 42],
            sampling=SamplingParams(temperature=0, max_new_tokens=5),
        )
    )
    sched.add_request(late)
    finished = _drain(sched)
    monkeypatch.setattr(sched.cache, "load_back", real_load_back)
    assert calls["n"] == 1
    assert finished["late"].finish_reason.type == "abort"
    assert "injected load-back fault" in finished["late"].finish_reason.message
    assert finished["steady"].finish_reason.type in ("stop", "length")
    assert sched.kv.is_fully_free()
    result = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 32})
    assert result.text == "The capital of France is Paris."


def test_a_failure_while_caching_a_chunk_frees_nothing_the_tree_owns(engine, monkeypatch):
    """A chunked prefill caches each chunk in the radix tree (``cache_unfinished_req``);
    an error after the chunk's insert ends the request, and the pages the tree took over
    are not freed again with it (they were: "KV page freed twice" on later evictions)."""
    sched = engine.scheduler
    cache = sched.cache
    # chunks of 32 tokens: the prompt is cached chunk by chunk
    monkeypatch.setattr(sched, "config", dataclasses.replace(sched.config, chunked_prefill_size=32))
    ids = engine.encode(PROMPT) * 8
    real_unfinished, real_match = cache.cache_unfinished_req, cache.match_prefix
    inside = {"now": False, "failed": 0}

    def unfinished(req):
        inside["now"] = True
        try:
            return real_unfinished(req)
        finally:
            inside["now"] = False

    def match(token_ids, extra_key=None):
        if inside["now"]:
            inside["failed"] += 1
            raise RuntimeError("injected fault after the chunk's insert")
        return real_match(token_ids, extra_key)

    monkeypatch.setattr(cache, "cache_unfinished_req", unfinished)
    monkeypatch.setattr(cache, "match_prefix", match)
    req = Req(
        GenerateRequest(
            rid="chunked", input_ids=ids, sampling=SamplingParams(temperature=0, max_new_tokens=4)
        )
    )
    sched.add_request(req)
    finished = _drain(sched)
    monkeypatch.undo()
    assert inside["failed"] == 1
    assert finished["chunked"].finish_reason.type == "abort"
    assert "injected fault" in finished["chunked"].finish_reason.message
    assert sched.kv.is_fully_free()
    cache.evict(cache.evictable_size())  # every cached page freed exactly once
    assert sched.kv.is_fully_free()
    result = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 32})
    assert result.text == "The capital of France is Paris."


def test_a_request_failing_on_its_token_does_not_fail_the_batch(engine, monkeypatch):
    sched = engine.scheduler
    ids = engine.encode(PROMPT)
    good = Req(
        GenerateRequest(
            rid="good",
            input_ids=ids,
            sampling=SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True),
        )
    )
    bad = Req(
        GenerateRequest(
            rid="bad",
            input_ids=ids,
            sampling=SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True),
        )
    )
    real_append = Req.append_token

    def append(self, token_id, context_len):
        if self.rid == "bad" and len(self.output_ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_append(self, token_id, context_len)

    monkeypatch.setattr(Req, "append_token", append)
    sched.add_request(good)
    sched.add_request(bad)
    finished = _drain(sched)
    assert finished["bad"].finish_reason.type == "abort"
    assert "internal error" in finished["bad"].finish_reason.message
    assert finished["good"].finish_reason.type == "length"
    assert len(good.output_ids) == 8
    assert sched.kv.is_fully_free()


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1e-300, "max_new_tokens": 4},
        {"temperature": 1e-300, "top_k": 2**31 - 1, "top_p": 1e-300, "max_new_tokens": 4},
        {"seed": 2**64 - 1, "n": 2, "temperature": 0.7, "max_new_tokens": 4},
        {"seed": -(2**63), "temperature": 0.7, "max_new_tokens": 4},
    ],
)
def test_extreme_but_valid_sampling_values_generate(engine, params):
    results = engine.generate(PROMPT, params)
    results = results if isinstance(results, list) else [results]
    assert all(r.finish_reason.type in ("stop", "length") for r in results)


def test_tiny_temperature_is_greedy(engine):
    greedy = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 12})
    tiny = engine.generate(PROMPT, {"temperature": 1e-300, "max_new_tokens": 12})
    assert tiny.output_ids == greedy.output_ids


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"seed": 2**70}, "seed"),
        ({"temperature": float("nan")}, "finite"),
        ({"top_p": float("inf")}, "finite"),
        ({"top_k": 2**70}, "top_k"),
        ({"min_new_tokens": 2**70}, "min_new_tokens"),
        ({"max_new_tokens": "5"}, "wrong type"),
    ],
)
def test_out_of_range_sampling_values_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(params)


def test_without_isolation_a_failing_step_raises(model_path, monkeypatch):
    """A tensor-parallel rank's scheduler (``isolate_failures`` off) does not abort the
    batch and go on alone: the error propagates, and the rank's process ends the server."""
    from kvflow.runtime.engine import Engine

    engine = Engine(str(model_path), max_total_tokens=2000)
    engine.scheduler.isolate_failures = False

    def broken(fb):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.runner, "forward", broken)
    engine.scheduler.add_request(
        engine.reqs.make(
            GenerateRequest(
                rid="raise-0",
                input_ids=engine.encode(PROMPT),
                sampling=SamplingParams(temperature=0, max_new_tokens=4),
            )
        )
    )
    with pytest.raises(RuntimeError, match="injected"):
        engine.scheduler.step()
