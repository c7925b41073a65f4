"""Native Llama-family model (Llama, Qwen2, Mistral shapes): GQA, RoPE, SwiGLU, RMSNorm.

Projections are merged (``qkv_proj``, ``gate_up_proj``) so each layer runs two big
matmuls instead of five; :meth:`LlamaForCausalLM.load_weights` maps Hugging Face names
onto them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvflow.runtime.config import ModelConfig
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.layers import (
    PackedWeight,
    RMSNorm,
    RotaryEmbedding,
    gate_up_silu,
    linear,
    matmul_weight,
    pack_linears,
    pack_weight,
)

__all__ = ["LlamaForCausalLM"]

# HF parameter suffix -> (our parameter suffix, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.rotary = rotary

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch, attn
    ) -> torch.Tensor:
        cfg = self.config
        qkv = linear(self.qkv_proj, hidden)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rotary(positions, q, k)
        out = attn.forward(q, k, v, self.layer_id, fb)
        return linear(self.o_proj, out.reshape(-1, cfg.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(self.down_proj, gate_up_silu(self.gate_up_proj, hidden))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, fb, attn):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, fb, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """``forward`` returns hidden states of the new tokens; ``compute_logits`` the logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.packed_head: PackedWeight | None = None  # see pack_for_cpu
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(self, fb: ForwardBatch, attn) -> torch.Tensor:
        hidden = self.embed_tokens(fb.input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(fb.positions, hidden, residual, fb, attn)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return matmul_weight(hidden, self._head_weight(), self.packed_head).float()

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_for_cpu(self) -> int:
        """Prepack the projections and the LM head for CPU matmuls (after loading weights);
        returns how many weights were packed."""
        self.packed_head = pack_weight(self._head_weight())
        gate_up = tuple(m.gate_up_proj for m in self.modules() if isinstance(m, LlamaMLP))
        return pack_linears(self.layers, gate_up) + (self.packed_head is not None)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the merged parameters."""
        params = dict(self.named_parameters())
        cfg = self.config
        shard_sizes = {
            "qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
            "gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
        }
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            for hf_part, (ours, shard) in _STACKED.items():
                if f".{hf_part}." in name:
                    name = name.replace(hf_part, ours)
                    sizes = shard_sizes[ours]
                    offset = sum(sizes[:shard])
                    params[name].data[offset : offset + sizes[shard]].copy_(tensor)
                    loaded.add(f"{name}#{shard}")
                    break
            else:
                if name not in params:
                    raise KeyError(f"checkpoint tensor {hf_name!r} has no matching parameter")
                params[name].data.copy_(tensor)
                loaded.add(name)
        expected = {
            n
            for n in params
            if "qkv_proj.weight" not in n and "gate_up_proj" not in n and "qkv_proj.bias" not in n
        }
        missing = sorted(n for n in expected if n not in loaded)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
