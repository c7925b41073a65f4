"""Decoder blocks shared by the model families: attention, gated MLP (or a mixture of
experts), decoder layer.

Each takes the model's :class:`~kvflow.runtime.layers.LinearMethod`, so a weight format
reaches every projection without a family knowing about it, and the tensor-parallel group
(``tp``, None for one rank): attention keeps the rank's heads, the MLP its part of the
width, and the output projections all-reduce.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kvflow.runtime.attention import AttentionBackend
from kvflow.runtime.config import ModelConfig
from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.layers import (
    GateUpLinear,
    GemmaRMSNorm,
    LinearMethod,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SparseMoE,
)

__all__ = [
    "MERGED_PROJECTIONS",
    "Attention",
    "DecoderLayer",
    "GatedMLP",
    "QKNormAttention",
    "layer_mlp",
]

# The Hugging Face projections these blocks merge: checkpoint name part -> (our merged
# layer, its shard id); a family's ``stacked_params`` (see CausalLM) when it keeps them.
MERGED_PROJECTIONS: dict[str, tuple[str, int | str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    """``qkv_proj`` -> :meth:`norm_qk` -> rotary on q and k -> the attention backend over
    the paged KV cache (which stores this step's k and v) -> ``o_proj``: ``[tokens,
    hidden]`` -> same."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            config.attention_bias,
            method,
            tp,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.heads[:2]  # this rank's
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, False, method, tp)
        self.rotary = rotary

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        fb: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.norm_qk(q, k)
        q, k = self.rotary(positions, q, k)
        out = attn.forward(q, k, v, self.layer_id, fb)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A family's hook on ``q`` ``[tokens, heads, head_dim]`` and ``k`` before rotary;
        none here."""
        return q, k


class QKNormAttention(Attention):
    """Attention with an RMSNorm over each head of q and of k before rotary (Qwen3): one
    ``head_dim`` weight each, shared by the heads, so every rank holds all of it.
    ``qk_norm`` is the norm's class (Gemma 3: :class:`GemmaRMSNorm`)."""

    qk_norm: ClassVar[type[RMSNorm] | type[GemmaRMSNorm]] = RMSNorm

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(config, layer_id, rotary, method, tp)
        self.q_norm = self.qk_norm(config.head_dim, config.rms_norm_eps)
        self.k_norm = self.qk_norm(config.head_dim, config.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # rows of head_dim: the norm kernels take [rows, width]
        q_normed: torch.Tensor = self.q_norm(q.reshape(-1, self.head_dim))  # type: ignore[assignment]
        k_normed: torch.Tensor = self.k_norm(k.reshape(-1, self.head_dim))  # type: ignore[assignment]
        return q_normed.view(q.shape), k_normed.view(k.shape)


class GatedMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, gate and up merged."""

    def __init__(
        self, config: ModelConfig, method: LinearMethod | None = None, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(config.hidden_size, config.intermediate_size, method, tp)
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, False, method, tp
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_mul(hidden))


def layer_mlp(
    config: ModelConfig, layer_id: int, method: LinearMethod | None, tp: TPGroup | None
) -> nn.Module:
    """A mixture-of-experts family's MLP of layer ``layer_id``: :class:`SparseMoE` where
    :meth:`ModelConfig.is_sparse_layer`, else a :class:`GatedMLP`. The experts take their
    method from :meth:`CausalLM.quantize`; the dense layers take ``method``."""
    if not config.is_sparse_layer(layer_id):
        return GatedMLP(config, method, tp)
    return SparseMoE(
        config.num_experts,
        config.num_experts_per_tok,
        config.hidden_size,
        config.moe_intermediate_size,
        config.norm_topk_prob,
        tp,
    )


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual around it. The residual travels
    beside the hidden state: ``forward`` returns ``(mlp_out, residual)``, and the next
    layer's (or the final) norm adds them (fused into the RMSNorm kernel). ``attention``
    is the family's :class:`Attention` class, ``mlp`` its MLP module (default a
    :class:`GatedMLP`)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None = None,
        tp: TPGroup | None = None,
        attention: type[Attention] = Attention,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = attention(config, layer_id, rotary, method, tp)
        self.mlp = mlp if mlp is not None else GatedMLP(config, method, tp)
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
