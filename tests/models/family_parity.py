"""Tiny random-weight Hugging Face checkpoints and greedy decoding through transformers and
through kvflow's engine, for token-for-token comparison."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MAX_NEW = 24
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 515,
    "max_position_embeddings": 512,
}
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW}


def build_hf(folder: Path, model_cls: str, config_cls: str, **config: Any) -> torch.nn.Module:
    """Save a tiny ``model_cls`` (``TINY`` updated by ``config``) to ``folder``; weights
    larger than the default init so logits are peaked, biases and norm weights that
    matter."""
    import transformers

    torch.manual_seed(0)
    hf_config = getattr(transformers, config_cls)(**{**TINY, **config})
    hf = getattr(transformers, model_cls)(hf_config).to(torch.float32)
    for name, param in hf.named_parameters():
        if param.dim() > 1:
            param.data.normal_(0, 0.08)
        elif name.endswith("bias"):
            param.data.normal_(0, 0.1)
        elif "q_norm" in name or "k_norm" in name:
            param.data.uniform_(0.5, 1.5)
    hf.save_pretrained(folder)
    return hf.eval()


def prompts(lengths: tuple[int, ...] = (3, 41, 17, 64, 5, 29, 9, 12)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf: torch.nn.Module, batch: list[list[int]], cache=None) -> list[list[int]]:
    """Greedy tokens of each prompt; ``cache``: a class of transformers cache to use."""
    outputs = []
    with torch.no_grad():
        for ids in batch:
            prompt = torch.tensor([ids])
            full = hf.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),  # (inferred, it hides tokens 0)
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=0,
                **({} if cache is None else {"past_key_values": cache()}),
            )
            outputs.append(full[0, len(ids) :].tolist())
    return outputs


def engine_greedy(folder: Path, batch: list[list[int]], **engine: Any) -> list[list[int]]:
    """One engine at tp 1, the whole batch in one call; checks that no KV memory leaks."""
    from kvflow.runtime.engine import Engine

    kw: dict[str, Any] = {"skip_tokenizer_init": True, "dtype": "float32", **engine}
    llm = Engine(str(folder), **kw)
    outputs = [r.output_ids for r in llm.generate(input_ids=batch, sampling_params=GREEDY)]
    assert llm.is_memory_free()
    return outputs
