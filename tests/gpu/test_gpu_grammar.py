"""Structured output on CUDA: the token bitmask applied by xgrammar's GPU kernel, with CUDA
graphs on and off, mixed batches, and logits wider than the tokenizer (padded vocabulary).

A small random Llama with a byte-level BPE tokenizer trained here (no download): random
weights make the unconstrained choice arbitrary, so only the mask keeps the constrained
requests inside their grammars. Skipped without CUDA; run with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import gc
import json
import re

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PADDED_VOCAB = 512  # the model's logits; the tokenizer has fewer tokens (padding)
CORPUS = [
    '{"name": "Ann", "age": 31, "tags": ["a", "b"]} the quick brown fox 0123456789',
    "yes no true false null red green blue cat dog bird - + . , : ; ( ) [ ] { }",
] * 50


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("grammar-llama")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    tokenizer.save_pretrained(folder)
    assert len(tokenizer) < PADDED_VOCAB
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=PADDED_VOCAB,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # the padded ids get the largest logits unless masked
        hf.lm_head.weight[len(tokenizer) :] = hf.lm_head.weight[: len(tokenizer)].abs().max()
    hf.save_pretrained(folder)
    return folder, len(tokenizer), tokenizer.eos_token_id


SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "n"],
}
CONSTRAINED = [
    ({"regex": r"[0-9]{2,6}"}, r"[0-9]{2,6}"),
    ({"ebnf": 'root ::= ("yes" | "no") (", " ("yes" | "no"))?'}, r"(yes|no)(, (yes|no))?"),
    ({"regex": r"(cat|dog|bird)-[a-z]{1,4}"}, r"(cat|dog|bird)-[a-z]{1,4}"),
]


def _engine(folder, cuda_graph: bool, device: str = "cuda"):
    from kvflow.runtime.engine import Engine

    return Engine(
        str(folder),
        dtype="float32",
        device=device,
        disable_cuda_graph=not cuda_graph,
        max_running_requests=16,
        cuda_graph_max_bs=16,
        max_total_tokens=8192,
    )


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_constrained_and_free_mixed_on_cuda(model_folder, cuda_graph):
    folder, tokenizer_vocab, eos = model_folder
    engine = _engine(folder, cuda_graph)
    free = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    prompts = ["the quick brown", "red green", "0123", "cat dog"]
    alone = [r.output_ids for r in engine.generate(prompts, free)]
    params, texts = [], []
    for i, prompt in enumerate(prompts):
        params.append(free)
        texts.append(prompt)
        extra, _ = CONSTRAINED[i % len(CONSTRAINED)]
        params.append({"temperature": 0, "max_new_tokens": 16, **extra})
        texts.append(prompt)
    params.append({"temperature": 0, "max_new_tokens": 128, "json_schema": json.dumps(SCHEMA)})
    texts.append("{")
    results = engine.generate(texts, params)
    assert [results[i].output_ids for i in range(0, 8, 2)] == alone
    for i in range(4):
        result = results[2 * i + 1]
        _, pattern = CONSTRAINED[i % len(CONSTRAINED)]
        assert result.finish_reason.type == "stop", result
        assert re.fullmatch(pattern, result.text), (pattern, result.text)
        assert all(t < tokenizer_vocab for t in result.output_ids)
        assert result.output_ids[-1] == eos
    doc = results[-1]
    assert doc.finish_reason.type == "stop", doc
    value = json.loads(doc.text)
    assert value["color"] in ("red", "green", "blue") and isinstance(value["n"], int)
    assert engine.is_memory_free()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def test_cuda_kernel_mask_equals_cpu(model_folder):
    """xgrammar's GPU kernel masks exactly what its CPU path masks, padded ids included."""
    from transformers import AutoTokenizer

    from kvflow.runtime.grammar import GrammarBackend, GrammarSpec, apply_grammar_masks

    folder, tokenizer_vocab, eos = model_folder
    backend = GrammarBackend(lambda: AutoTokenizer.from_pretrained(folder), PADDED_VOCAB, (eos,))
    try:
        grammars = []
        for spec in [GrammarSpec("regex", "[0-9]+"), None, GrammarSpec("json_schema", "{}")]:
            if spec is None:
                grammars.append(None)
                continue
            grammar = backend.request(spec)
            grammar.future.result(timeout=120)
            assert grammar.ready and grammar.error is None
            grammars.append(grammar)
        logits = torch.randn(3, PADDED_VOCAB, generator=torch.Generator().manual_seed(0))
        on_cpu, on_gpu = logits.clone(), logits.cuda()
        apply_grammar_masks(on_cpu, grammars)
        apply_grammar_masks(on_gpu, grammars)
        assert torch.equal(on_gpu.cpu(), on_cpu)
        assert torch.isinf(on_cpu[0, tokenizer_vocab:]).all()
        assert torch.equal(on_cpu[1], logits[1])
    finally:
        backend.shutdown()
