"""Tiny random-weight checkpoints for speculative decoding's tests: the target's config and
EAGLE / EAGLE-3 heads in SGLang's formats (imported by this folder's conftest and by
tests/pd/test_pd_eagle.py)."""

from __future__ import annotations

import json
from pathlib import Path

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "eos_token_id": 95,
}


def write_eagle_head(folder: Path, identity: bool = False, seed: int = 0, **overrides) -> str:
    """An EAGLE-1/2 head in SGLang's checkpoint format (``LlamaForCausalLMEagle``: ``fc``
    and one Llama decoder layer without input norm, no embedding or LM head), random
    weights from transformers' own Llama layer. ``identity``: ``fc`` passes the feature
    through and the layer adds nothing, so the head's output is the target's hidden state
    (its first draft is the target's own choice at the position before the last token)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    raw = {**TINY, "architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1}
    raw.update(overrides)
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(LlamaConfig(**raw), layer_idx=0)
    hidden = raw["hidden_size"]
    tensors = {
        f"layers.0.{name}": value.detach().clone()
        for name, value in layer.state_dict().items()
        if not name.startswith("input_layernorm")
    }
    for name in ("q_proj", "k_proj"):  # sharp attention: positions and KV matter
        tensors[f"layers.0.self_attn.{name}.weight"] *= 4
    fc = torch.nn.Linear(2 * hidden, hidden)
    tensors["fc.weight"], tensors["fc.bias"] = fc.weight.detach(), fc.bias.detach()
    if identity:
        tensors["fc.weight"] = torch.cat((torch.zeros(hidden, hidden), torch.eye(hidden)), 1)
        tensors["fc.bias"] = torch.zeros(hidden)
        for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
            tensors[name] = torch.zeros_like(tensors[name])
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


def write_eagle3_head(folder: Path, draft_vocab_size: int | None = 48, seed: int = 0) -> str:
    """An EAGLE-3 head in SGLang's checkpoint format (``LlamaForCausalLMEagle3``: ``fc``
    over three target layers, a ``midlayer`` whose attention reads ``2 * hidden``, a final
    norm; with ``draft_vocab_size``, its own LM head over that many tokens and ``d2t``
    mapping them onto every other target id), random weights."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    raw = {**TINY, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1}
    if draft_vocab_size is not None:
        raw["draft_vocab_size"] = draft_vocab_size
    torch.manual_seed(seed)
    wide = LlamaConfig(**{**raw, "hidden_size": 2 * TINY["hidden_size"], "head_dim": 16})
    attn = LlamaDecoderLayer(wide, layer_idx=0).self_attn  # q/k/v read 2 * hidden
    layer = LlamaDecoderLayer(LlamaConfig(**raw), layer_idx=0)
    hidden = raw["hidden_size"]
    tensors = {f"midlayer.{k}": v for k, v in layer.state_dict().items() if "self_attn" not in k}
    for name in ("q_proj", "k_proj", "v_proj"):
        tensors[f"midlayer.self_attn.{name}.weight"] = getattr(attn, name).weight
    tensors["midlayer.self_attn.o_proj.weight"] = layer.self_attn.o_proj.weight
    tensors["midlayer.hidden_norm.weight"] = torch.ones(hidden)
    tensors["norm.weight"] = torch.ones(hidden)
    tensors["fc.weight"] = torch.nn.Linear(3 * hidden, hidden, bias=False).weight
    if draft_vocab_size is not None:
        tensors["lm_head.weight"] = torch.randn(draft_vocab_size, hidden) * 0.05
        targets = torch.arange(draft_vocab_size) * 2  # draft id i is target id 2i
        tensors["d2t"] = targets - torch.arange(draft_vocab_size)
        tensors["t2d"] = torch.zeros(TINY["vocab_size"], dtype=torch.bool).index_fill(
            0, targets, True
        )
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)
