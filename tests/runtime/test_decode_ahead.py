"""Building (and launching) the next decode step before the sampled tokens reach the host
changes no result: same tokens, finish reasons and freed memory with it on or off."""

from __future__ import annotations

from kvflow.runtime.sampling import SamplingParams
from kvflow.runtime.scheduler import Req
from kvflow.runtime.wire import GenerateRequest

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nCount from one to ten.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
]
PARAMS = [
    {"temperature": 0, "max_new_tokens": 24},  # ends on EOS
    {"temperature": 0, "max_new_tokens": 21, "ignore_eos": True},  # lengths only
    {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True, "min_new_tokens": 4},
    {"temperature": 1.0, "max_new_tokens": 15, "seed": 5, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},  # aborted mid-way
    {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True},  # arrives late
]


def run_scenario(engine, prepare: bool, launch: bool):
    sched = engine.scheduler
    sched.prepare_next_decode, sched.launch_ahead = prepare, launch
    assert engine.flush_cache()
    eos = engine.runner.model_config.eos_token_ids
    reqs = []
    for i, params in enumerate(PARAMS):
        ids = engine.encode(PROMPTS[i % len(PROMPTS)])
        reqs.append(
            Req(
                GenerateRequest(rid=f"r{i}", input_ids=ids, sampling=SamplingParams(**params)),
                eos_token_ids=eos,
            )
        )
    for req in reqs[:-1]:
        sched.add_request(req)
    launched_ahead = 0
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        if steps == 4:
            sched.add_request(reqs[-1])
        if steps == 9:
            assert sched.abort_request("r4") is not None
        if sched._next is not None and sched._next.logits is not None:
            launched_ahead += 1
    assert engine.is_memory_free()
    return [(r.output_ids, r.finished_reason) for r in reqs], launched_ahead


def test_results_do_not_depend_on_building_ahead(make_engine):
    engine = make_engine(page_size=4)
    plain, _ = run_scenario(engine, prepare=False, launch=False)
    built, _ = run_scenario(engine, prepare=True, launch=False)
    launched, launched_ahead = run_scenario(engine, prepare=True, launch=True)
    assert plain == built == launched
    assert launched_ahead > 0
    assert [reason.type for _, reason in plain] == [
        "stop",
        "length",
        "length",
        "length",
        "abort",
        "length",
    ]
    assert [len(ids) for ids, _ in plain][1:4] == [21, 30, 15]


def _join_scenario(engine, launch: bool):
    """A decoding; after a few steps B joins with its prompt KV in place (the PD decode's
    path: pre-allocate, zero, join with the prefill's first token)."""
    from kvflow.runtime.scheduler import SchedulerPort

    sched = engine.scheduler
    sched.prepare_next_decode, sched.launch_ahead = True, launch
    assert engine.flush_cache()
    port = SchedulerPort(sched)
    eos = engine.runner.model_config.eos_token_ids
    a, b = (
        Req(
            GenerateRequest(
                rid=f"j{i}",
                input_ids=engine.encode(PROMPTS[i]),
                sampling=SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True),
            ),
            eos_token_ids=eos,
        )
        for i in range(2)
    )
    forwards = 0
    real = engine.runner.forward

    def counted(fb):
        nonlocal forwards
        forwards += 1
        return real(fb)

    engine.runner.forward = counted
    first_step = sched.forward_steps
    try:
        sched.add_request(a)
        steps = 0
        while sched.has_work():
            sched.step()
            steps += 1
            if steps == 4:
                assert launch == (sched._next is not None and sched._next.logits is not None)
                assert port.preallocate(b)
                port.zero_prompt_slots(b)
                port.join_running(b, first_token=a.output_ids[0], logprob=None, top=None)
            if steps == 5 and launch:  # the step after the join is built with B, and launched
                assert sched._next is not None and sched._next.logits is not None
                assert [r.rid for r in sched._next.reqs] == ["j0", "j1"]
    finally:
        engine.runner.forward = real
    assert engine.is_memory_free()
    wasted = forwards - (sched.forward_steps - first_step)
    return [(r.output_ids, r.finished_reason) for r in (a, b)], wasted


def test_a_request_joining_does_not_waste_the_step_launched_ahead(make_engine):
    """The step launched before B joined runs as launched (B decodes from the next one,
    launched ahead with A): every forward pass is a step that ran, and the tokens are those
    of the plain path."""
    engine = make_engine(page_size=4)
    plain, _ = _join_scenario(engine, launch=False)
    launched, wasted = _join_scenario(engine, launch=True)
    assert plain == launched
    assert wasted == 0
    assert [len(ids) for ids, _ in plain] == [12, 12]
