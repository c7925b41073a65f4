"""Greedy output with speculation equals greedy output without it, token for token: on the
embedded model (NGRAM; stop strings, EOS, max_tokens cut-offs, logprobs) and on tiny
random-weight models (NGRAM and STANDALONE, page sizes 1 and 4)."""

from __future__ import annotations

import pytest

CODE = "def area(width, height):\n    return width * height\n\nprint(area(3, 4))\n"
PROMPTS = [
    f"<|im_start|>user\nRepeat this code, renaming width to w:\n{CODE}<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nCount from one to ten.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nCopy this text: the cat sat on the mat. the cat sat on the mat."
    "<|im_end|>\n<|im_start|>assistant\n",
]
PARAMS = [
    {"temperature": 0, "max_new_tokens": 48},  # quotes its input; may end on EOS
    {"temperature": 0, "max_new_tokens": 24},  # ends on EOS
    {"temperature": 0, "max_new_tokens": 40, "stop": ["seven"]},  # a stop string
    {"temperature": 0, "max_new_tokens": 13, "ignore_eos": True},  # a max_tokens cut-off
]


@pytest.fixture(scope="module")
def spec_engine(model_path):
    """One NGRAM engine on the embedded model; its plain reference is the same engine with
    the verify step detached (one model load instead of two)."""
    from kvflow.runtime.engine import Engine

    engine = Engine(
        str(model_path),
        dtype="float32",
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=6,
    )
    yield engine
    assert engine.is_memory_free()


def plain_generate(engine, *args, **kwargs):
    """``engine.generate`` with speculation off (decode steps, built ahead as usual)."""
    sched = engine.scheduler
    spec, sched.spec = sched.spec, None
    sched.prepare_next_decode = True
    try:
        return engine.generate(*args, **kwargs)
    finally:
        sched.spec, sched.prepare_next_decode = spec, False


def test_ngram_equals_plain_greedy_on_the_embedded_model(spec_engine):
    spec = spec_engine
    expected = plain_generate(spec, PROMPTS, PARAMS, return_logprob=True, top_logprobs_num=2)
    assert spec.flush_cache()
    got = spec.generate(PROMPTS, PARAMS, return_logprob=True, top_logprobs_num=2)
    for want, have in zip(expected, got, strict=True):
        assert have.output_ids == want.output_ids
        assert have.finish_reason == want.finish_reason
        assert have.text == want.text
        assert have.logprobs == pytest.approx(want.logprobs, abs=1e-3)
        assert [[t for t, _ in top] for top in have.top_logprobs] == [
            [t for t, _ in top] for top in want.top_logprobs
        ]
    assert {r.finish_reason.type for r in got} == {"stop", "length"}
    worker = spec.scheduler.spec
    assert worker.accepted_tokens > 0  # the quoting prompt did accept drafts
    assert worker.accept_length > 1.0
    assert spec.is_memory_free()


def _tiny_prompts() -> list[list[int]]:
    # repetitive prompts, so NGRAM finds matches; the random model loops too
    return [[(5 * i + j % (3 + i)) % 90 for j in range(9 + 7 * i)] for i in range(4)]


TINY_PARAMS = [
    {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 17, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 25, "stop_token_ids": [7, 11]},
    {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True},
]


@pytest.mark.parametrize("page_size", [1, 4])
def test_tiny_models_equal_plain_greedy(tiny_models, tiny_engine, page_size):
    target = tiny_models["target"]
    plain = tiny_engine(target, page_size=page_size)
    want = [
        r.output_ids for r in plain.generate(input_ids=_tiny_prompts(), sampling_params=TINY_PARAMS)
    ]
    engines = {
        "ngram": tiny_engine(
            target, page_size=page_size, speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=5,
        ),
        "standalone-shallow": tiny_engine(
            target, page_size=page_size, speculative_algorithm="STANDALONE",
            speculative_draft_model_path=tiny_models["shallow"], speculative_num_steps=3,
        ),
        "standalone-same": tiny_engine(
            target, page_size=page_size, speculative_algorithm="STANDALONE",
            speculative_draft_model_path=target, speculative_num_steps=4,
        ),
    }  # fmt: skip
    for name, engine in engines.items():
        for _ in range(2):  # the second round starts from cached prefixes
            got = engine.generate(input_ids=_tiny_prompts(), sampling_params=TINY_PARAMS)
            assert [r.output_ids for r in got] == want, name
        assert engine.is_memory_free(), name
    # a draft with the target's own weights is always right: every step keeps 5 tokens
    # (num_steps + 1) but where max_new_tokens or a stop ends it first
    same = engines["standalone-same"].scheduler.spec
    assert same.accepted_tokens == same.drafted_tokens > 0
    shallow = engines["standalone-shallow"].scheduler.spec
    assert shallow.accepted_tokens < shallow.drafted_tokens
