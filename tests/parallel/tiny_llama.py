"""A random-weight Llama small enough for CPU servers (4 heads, 2 KV heads: one per rank at
``--tp-size 2``) over SmolLM2's vocabulary, so the embedded model's tokenizer serves it."""

from __future__ import annotations

from pathlib import Path

import torch

EOS = 2  # SmolLM2's <|im_end|>: the tiny model shares its tokenizer


def save_tiny_llama(folder: Path) -> torch.nn.Module:
    """Write the checkpoint into ``folder``; returns the transformers model (eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=2048,
        eos_token_id=EOS,
    )
    hf = LlamaForCausalLM(config).to(torch.float32)
    for param in hf.parameters():  # peaked logits: greedy choices far from ties
        if param.dim() > 1:
            param.data.normal_(0, 0.08)
    hf.save_pretrained(folder)
    return hf.eval()


def hf_greedy(hf: torch.nn.Module, ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` (at most ``max_new`` tokens, EOS ends;
    any model of SmolLM2's EOS id)."""
    with torch.no_grad():
        full = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),  # id 0 is no pad
            max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=0,
        )  # fmt: skip
    return full[0, len(ids) :].tolist()
