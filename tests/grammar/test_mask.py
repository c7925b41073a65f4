"""The grammar pieces on CPU without a model: spec checks, the compile cache, the token
bitmask on mixed batches (also with a padded vocabulary), logit_bias in the sampler."""

from __future__ import annotations

import json

import pytest
import torch

from kvflow.runtime.core import Req
from kvflow.runtime.grammar import (
    GrammarBackend,
    GrammarError,
    GrammarSpec,
    apply_grammar_masks,
    check_grammar,
)
from kvflow.runtime.sampling import Sampler, SamplingBatch
from kvflow.runtime.wire import GenerateRequest, SamplingParams


def compiled(backend: GrammarBackend, kind: str, text: str):
    grammar = backend.request(GrammarSpec(kind, text))
    grammar.future.result(timeout=60)
    assert grammar.ready and grammar.error is None
    return grammar


def allowed(tokenizer, logits_row: torch.Tensor) -> list[str]:
    ids = torch.isfinite(logits_row).nonzero().flatten().tolist()
    return [tokenizer.decode([i]) for i in ids]


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("json_schema", '{"type": "objecct"}', 'Unsupported type "objecct"'),
        ("json_schema", "{not json", "not JSON"),
        ("json_schema", '{"$ref": "#/$defs/missing"}', "$defs"),
        ("regex", "a(b", "parenthesis is not closed"),
        ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
        ("ebnf", 'root := "a"', "EBNF lexer error"),
        ("structural_tag", '{"type": "structural_tag", "format": {"type": "x"}}', "not recognized"),
    ],
)
def test_invalid_specs_say_what_is_wrong(kind, text, message):
    with pytest.raises(GrammarError) as err:
        check_grammar(GrammarSpec(kind, text))
    assert message in str(err.value)
    assert str(err.value).startswith(f"invalid {kind}: ")
    assert ".cc:" not in str(err.value)  # xgrammar's source position is cut off


def test_compile_once_per_spec_and_bounded_cache(tokenizer):
    backend = GrammarBackend(
        lambda: tokenizer, len(tokenizer), (tokenizer.eos_token_id,), cache_size=2
    )
    try:
        first = backend.request(GrammarSpec("regex", "[0-9]+"))
        again = backend.request(GrammarSpec("regex", "[0-9]+"))
        assert first.future is again.future and backend.compiles == 1
        backend.request(GrammarSpec("regex", "[a-z]+"))
        backend.request(GrammarSpec("regex", "x"))  # evicts [0-9]+ (least recently used)
        assert backend.cached == 2
        backend.request(GrammarSpec("regex", "[0-9]+"))
        assert backend.compiles == 4
    finally:
        backend.shutdown()


def test_compile_error_is_reported_on_the_request(backend):
    grammar = backend.request(GrammarSpec("ebnf", "root ::= undefined_rule"))
    with pytest.raises(GrammarError):
        grammar.future.result(timeout=60)
    assert grammar.ready and "undefined_rule" in (grammar.error or "")


def test_mask_on_mixed_batch_leaves_free_rows_alone(backend, tokenizer):
    digits = compiled(backend, "regex", "[0-9]+")
    brace = compiled(backend, "json_schema", json.dumps({"type": "object"}))
    vocab = len(tokenizer)
    torch.manual_seed(0)
    logits = torch.randn(4, vocab)
    before = logits.clone()
    apply_grammar_masks(logits, [None, digits, None, brace])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    digit_texts = allowed(tokenizer, logits[1])
    assert digit_texts and all(t.isdigit() for t in digit_texts)
    assert "7" in digit_texts
    assert set(allowed(tokenizer, logits[3])) <= {"{", '{"', "{\n", " {", "{}", "{\r"}
    # the allowed logits keep their values
    keep = torch.isfinite(logits[1])
    assert torch.equal(logits[1][keep], before[1][keep])


def test_mask_covers_padded_vocabulary(tokenizer):
    """Logits wider than the tokenizer (padded vocab): padded ids are never allowed."""
    vocab, padded = len(tokenizer), len(tokenizer) + 96
    backend = GrammarBackend(lambda: tokenizer, padded, (tokenizer.eos_token_id,))
    try:
        grammar = compiled(backend, "regex", "[0-9]+")
        logits = torch.zeros(3, padded)
        logits[:, vocab:] = 100.0  # the padded ids would win an argmax
        apply_grammar_masks(logits, [grammar, None, grammar])
        assert torch.isinf(logits[0, vocab:]).all() and torch.isinf(logits[2, vocab:]).all()
        assert (logits[1, vocab:] == 100.0).all()
        assert tokenizer.decode([int(logits[0].argmax())]).isdigit()
    finally:
        backend.shutdown()


def test_all_free_batch_is_untouched(backend):
    logits = torch.randn(3, 64)
    before = logits.clone()
    apply_grammar_masks(logits, [None, None, None])
    assert torch.equal(logits, before)


def _req(rid: str, tokenizer, grammar=None, **params) -> Req:
    req = Req(
        GenerateRequest(
            rid=rid, input_ids=tokenizer.encode("Hi"), sampling=SamplingParams(**params)
        ),
        eos_token_ids=(2,),
    )
    req.grammar = grammar
    return req


def test_sampler_follows_grammar_step_by_step(backend, tokenizer):
    """Greedy through the sampler: every token the constrained row takes is accepted by its
    matcher and the text matches; the free row in the same batch takes plain argmax."""
    grammar = compiled(backend, "regex", "(yes|no)")
    constrained = _req("c", tokenizer, grammar, temperature=0.0, max_new_tokens=8)
    free = _req("f", tokenizer, temperature=0.0, max_new_tokens=8)
    vocab = len(tokenizer)
    sampler = Sampler(vocab, "cpu")
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        logits = torch.randn(2, vocab, generator=gen)
        batch = SamplingBatch.from_reqs([free, constrained], vocab, "cpu")
        out = sampler.sample(logits.clone(), batch)
        assert out.next_token_ids[0] == int(logits[0].argmax())
        constrained.append_token(out.next_token_ids[1], 4096)
        if constrained.finished:
            break
    assert constrained.finished_reason is not None
    assert constrained.finished_reason.type == "stop"
    text = tokenizer.decode(constrained.output_ids, skip_special_tokens=True)
    assert text in ("yes", "no")
    assert constrained.output_ids[-1] == 2  # ended by the EOS the grammar allowed at its end


def test_logit_bias_changes_the_greedy_choice(tokenizer):
    vocab = len(tokenizer)
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3))
    top = int(logits[0].argmax())
    target = (top + 17) % vocab
    biased = _req("b", tokenizer, temperature=0.0, logit_bias=((target, 100.0), (top, -100.0)))
    plain = _req("p", tokenizer, temperature=0.0)
    sampler = Sampler(vocab, "cpu")
    out = sampler.sample(logits.clone(), SamplingBatch.from_reqs([biased, plain], vocab, "cpu"))
    assert out.next_token_ids == [target, int(logits[1].argmax())]
