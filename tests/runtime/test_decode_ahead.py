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
