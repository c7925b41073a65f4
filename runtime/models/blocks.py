"""Decoder blocks shared by the model families: attention, gated MLP, decoder layer.

Each takes the model's :class:`~kvflow.runtime.layers.LinearMethod`, so a weight format
reaches every projection without a family knowing about it.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.runtime.attention import AttentionBackend
from kvflow.runtime.config import ModelConfig
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.layers import (
    GateUpLinear,
    LinearMethod,
    QKVLinear,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
)

__all__ = ["Attention", "DecoderLayer", "GatedMLP"]


class Attention(nn.Module):
    """``qkv_proj`` -> rotary on q and k -> the attention backend over the paged KV cache
    (which stores this step's k and v) -> ``o_proj``: ``[tokens, hidden]`` -> same."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        self.qkv_proj = QKVLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            config.attention_bias,
            method,
        )
        self.o_proj = ReplicatedLinear(config.q_size, config.hidden_size, False, method)
        self.rotary = rotary

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        fb: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        cfg = self.config
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rotary(positions, q, k)
        out = attn.forward(q, k, v, self.layer_id, fb)
        return self.o_proj(out.reshape(-1, cfg.q_size))


class GatedMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, gate and up merged."""

    def __init__(self, config: ModelConfig, method: LinearMethod | None = None) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(config.hidden_size, config.intermediate_size, method)
        self.down_proj = ReplicatedLinear(
            config.intermediate_size, config.hidden_size, False, method
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_mul(hidden))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual around it. The residual travels
    beside the hidden state: ``forward`` returns ``(mlp_out, residual)``, and the next
    layer's (or the final) norm adds them (fused into the RMSNorm kernel)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id, rotary, method)
        self.mlp = GatedMLP(config, method)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)  # type: ignore[assignment]
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, fb, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
