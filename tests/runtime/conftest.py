"""Runtime fixtures: one engine on the embedded model per test module; the parity prompts
and transformers' greedy output on them (computed once for every module that checks it)."""

from __future__ import annotations

import pytest

PARITY_MAX_NEW = 24
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Hi",
    "List three primary colors and explain why they are called primary in painting.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a short tip for learning to program, in one sentence, please, and make it practical.",
    "Name a planet.",
    "Explain what a radix tree is to a ten year old child who likes trees and puzzles a lot.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(CHAT.format(q)) for q in QUESTIONS]
    assert len({len(i) for i in ids}) >= 8, "prompts must have different lengths"
    return ids


@pytest.fixture(scope="session")
def hf_greedy(hf_model, prompts) -> list[list[int]]:
    """Each prompt alone through transformers' float32 generate (no padding), greedy."""
    import torch

    outputs = []
    with torch.no_grad():
        for ids in prompts:
            full = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=PARITY_MAX_NEW,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )
            outputs.append(full[0, len(ids) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def engine(model_path):
    """A float32 engine shared by a module's tests (see ``make_engine``); it must end with
    all KV memory free."""
    from kvflow.runtime.engine import Engine

    engine = Engine(str(model_path), dtype="float32")
    yield engine
    assert engine.is_memory_free()
