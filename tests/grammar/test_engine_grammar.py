"""Constrained requests inside the scheduler (in-process engine on the embedded model):
retraction, decode built ahead, n > 1 samples, ignore_eos, aborts while compiling and
compile errors that reach the scheduler."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from schemas import SCHEMAS

from kvflow.runtime.wire import GenerateRequest, SamplingParams

NAMES = ["nested_object", "array_of_objects", "ref_defs", "date_like", "optional_fields"]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Give an example as JSON ({name})."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for name in NAMES
    ]


def _params(**extra) -> list[dict]:
    return [
        {"json_schema": json.dumps(SCHEMAS[n]), "max_new_tokens": 80, "temperature": 0, **extra}
        for n in NAMES
    ]


def _check(results) -> list[list[int]]:
    for name, result in zip(NAMES, results, strict=True):
        assert result.finish_reason.type == "stop", (name, result)
        jsonschema.validate(json.loads(result.text), SCHEMAS[name])
    return [r.output_ids for r in results]


@pytest.fixture(scope="module")
def reference(model_path, prompts) -> list[list[int]]:
    """Greedy ids with plenty of memory and no step built ahead."""
    from kvflow.runtime.engine import Engine

    engine = Engine(str(model_path), dtype="float32")  # make_engine's dtype
    engine.scheduler.prepare_next_decode = False
    ids = _check(engine.generate(prompts, _params()))
    assert engine.is_memory_free()
    return ids


def test_retracted_constrained_requests_resume_their_grammar(make_engine, prompts, reference):
    """A KV pool too small for all of them: requests are retracted and re-run their prompt
    and output; the matcher state they keep must fit the tokens they continue from."""
    engine = make_engine(max_total_tokens=200, disable_radix_cache=True)
    engine.scheduler.new_token_ratio = 0.1  # optimistic admission: growth must retract
    ids = _check(engine.generate(prompts, _params()))
    assert engine.scheduler.num_retractions > 0
    assert ids == reference


def test_decode_built_ahead_gives_the_same_tokens(make_engine, prompts, reference):
    engine = make_engine()
    assert engine.scheduler.prepare_next_decode
    assert _check(engine.generate(prompts, _params())) == reference


def test_grammar_end_finishes_even_with_ignore_eos(make_engine, prompts):
    engine = make_engine()
    results = engine.generate(prompts[:2], _params(ignore_eos=True)[:2])
    for result in results:
        assert result.finish_reason.type == "stop"
        assert len(result.output_ids) < 80


def test_sampled_samples_each_follow_the_grammar(make_engine, prompts):
    engine = make_engine()
    params = {"regex": r"(red|green|blue)( and (red|green|blue))?", "n": 4,
              "temperature": 1.0, "seed": 7, "max_new_tokens": 12}  # fmt: skip
    results = engine.generate(prompts[0], params)
    assert len(results) == 4
    for result in results:
        assert re.fullmatch(params["regex"], result.text), result.text


def test_compile_error_in_the_scheduler_aborts_the_request(make_engine, prompts):
    """The in-process engine does not check grammars at entry: the compile's error ends
    the request (a server answers 400 before it gets here)."""
    engine = make_engine()
    bad, good = {"ebnf": "root ::= missing", "max_new_tokens": 4}, {"max_new_tokens": 4}
    results = engine.generate(prompts[:2], [bad, good])
    assert results[0].finish_reason.type == "abort"
    assert 'Rule "missing" is not defined' in results[0].finish_reason.message
    assert results[1].finish_reason.type == "length"


def test_abort_while_compiling_frees_the_request(make_engine, prompts):
    from test_structured_server import _big_schema

    engine = make_engine()
    params = SamplingParams(json_schema=json.dumps(_big_schema(40)), max_new_tokens=4)
    req = engine.reqs.make(
        GenerateRequest(rid="slow", input_ids=engine.encode(prompts[0]), sampling=params)
    )
    engine.scheduler.add_request(req)
    assert engine.scheduler.grammar_wait == [req]
    out = engine.scheduler.abort_request("slow")
    assert out is not None and out.finish_reason.type == "abort"
    assert not engine.scheduler.has_work()
    req.grammar.future.result(timeout=300)  # the compile ends on its own (and stays cached)
