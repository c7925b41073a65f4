"""Greedy output with tensor parallelism equals one rank and Hugging Face transformers,
token for token: prompts of different lengths in one batch, with chunked prefill, radix
hits and retraction in play."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_llama import hf_greedy
from tp_ranks import run_ranks

MAX_NEW = 24
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 515,  # not a multiple of 2: the vocabulary's last rank is padded
    "max_position_embeddings": 512,
}
# (transformers class, extra config): untied Llama with 2 KV heads (one per rank at tp 2),
# tied Qwen2 (QKV bias) with 1 KV head (replicated on both ranks).
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {"num_key_value_heads": 2}),
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        {"num_key_value_heads": 1, "tie_word_embeddings": True},
    ),
}


def _build(folder: Path, family: str) -> torch.nn.Module:
    import transformers

    model_cls, config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**TINY, **extra)
    hf = getattr(transformers, model_cls)(config).to(torch.float32)
    for name, param in hf.named_parameters():  # peaked logits; biases that matter
        if param.dim() > 1:
            param.data.normal_(0, 0.08)
        elif name.endswith("bias"):
            param.data.normal_(0, 0.1)
    hf.save_pretrained(folder)
    return hf.eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 41, 17, 64, 5, 29, 9, 12)
    ]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tp2_equals_tp1_and_transformers(tmp_path, family):
    hf = _build(tmp_path, family)
    prompts = _prompts()
    expected = [hf_greedy(hf, ids, MAX_NEW) for ids in prompts]
    greedy = {"temperature": 0, "max_new_tokens": MAX_NEW}
    # the same prompts again: their prefixes hit the radix cache
    calls = [{"input_ids": prompts, "sampling_params": greedy}] * 2
    # a pool too small for the batch's outputs (retraction) and small chunks (chunked prefill)
    engine = {
        "chunked_prefill_size": 16,
        "max_total_tokens": 160,
        "dtype": "float32",
        "skip_tokenizer_init": True,
    }
    one = run_ranks(1, str(tmp_path), calls, **engine)[0]
    reports = run_ranks(2, str(tmp_path), calls, **engine)
    for report in reports:  # every rank ran the same schedule to the same end
        assert report["outputs"] == [expected, expected]
        assert report["memory_free"]
    assert one["outputs"] == [expected, expected]
    assert reports[0]["retractions"] > 0, "the test must make the scheduler retract"
    assert reports[0]["retractions"] == one["retractions"]
    assert [r["kv_heads"] for r in reports] == [1, 1]


def test_embedded_tp3_equals_tp1(model_path, tokenizer):
    """SmolLM2-135M: 9 heads and 3 KV heads, one of each kind per rank at tp 3."""
    questions = ["What is the capital of France?", "Hi", "Name three colors of the rainbow."]
    prompts = [tokenizer.encode(q) for q in questions]
    greedy = {"temperature": 0, "max_new_tokens": 16}
    calls = [{"input_ids": prompts, "sampling_params": greedy}]
    one = run_ranks(1, str(model_path), calls)[0]
    three = run_ranks(3, str(model_path), calls)
    assert [r["outputs"] for r in three] == [one["outputs"]] * 3
    assert all(r["kv_heads"] == 1 for r in three)
