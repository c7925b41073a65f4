"""A tiny random Llama saved as safetensors, random PEFT adapters for it (B nonzero: PEFT
starts B at zero), and greedy references through transformers + PeftModel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MAX_NEW = 16
TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 301,
    "max_position_embeddings": 256,
}
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


def build_base(folder: Path) -> None:
    """Save a tiny LlamaForCausalLM with peaked logits (weights ~N(0, 0.08))."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).float()
    for param in hf.parameters():
        if param.dim() > 1:
            param.data.normal_(0, 0.08)
    hf.save_pretrained(folder)


def load_base(folder: Path) -> torch.nn.Module:
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def build_adapter(base: Path, folder: Path, seed: int, **lora: Any) -> None:
    """Save a PEFT LoRA adapter of ``base`` with every A and B drawn at random."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(lora_dropout=0.0, **lora)
    model = get_peft_model(load_base(base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    model.save_pretrained(folder)


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens of each prompt, through PeftModel when ``adapter``."""
    model = load_base(base)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            full = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(full[0, len(ids) :].tolist())
    return outputs


def prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 300, (n,), generator=generator).tolist() for n in lengths]
