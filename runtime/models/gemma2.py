"""Gemma 2: GQA with RoPE on every layer, local sliding-window layers alternating with
global ones (the config's ``layer_types``), attention scaled by ``query_pre_attn_scalar``
and soft-capped (both in the attention backend), Gemma's RMSNorm (``1 + w``) before and
after both the attention and the MLP, a GeGLU MLP, embeddings scaled by sqrt(hidden), a
tied head and soft-capped final logits."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kvflow.kernels import softcap_ref
from kvflow.runtime.attention import AttentionBackend
from kvflow.runtime.config import ModelConfig
from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.layers import (
    GateUpLinear,
    GemmaRMSNorm,
    LinearMethod,
    RotaryEmbedding,
    RowParallelLinear,
    gelu_tanh_and_mul,
)
from kvflow.runtime.models.blocks import MERGED_PROJECTIONS, Attention
from kvflow.runtime.models.causal_lm import CausalLM

__all__ = ["Gemma2ForCausalLM", "GemmaDecoderLayer", "GemmaMLP"]


class GemmaMLP(nn.Module):
    """GeGLU: ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``, gate and up merged."""

    def __init__(
        self, config: ModelConfig, method: LinearMethod | None = None, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(config.hidden_size, config.intermediate_size, method, tp)
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, False, method, tp
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(hidden)))


class GemmaDecoderLayer(nn.Module):
    """``x + post_ff(mlp(pre_ff(h)))`` with ``h = x + post_attn(attn(input(x)))``, every
    norm a :class:`GemmaRMSNorm`. As :class:`~kvflow.runtime.models.blocks.DecoderLayer`,
    the residual travels beside the hidden state (the next layer's input norm, or the final
    norm, adds them), so ``forward`` returns ``(post_ff output, residual)``."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None,
        tp: TPGroup | None,
        attention: type[Attention],
    ) -> None:
        super().__init__()
        self.self_attn = attention(config, layer_id, rotary, method, tp)
        self.mlp = GemmaMLP(config, method, tp)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

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
        hidden = self.post_attention_layernorm(hidden)  # type: ignore[assignment]
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.post_feedforward_layernorm(self.mlp(hidden))  # type: ignore[assignment]
        return hidden, residual


class Gemma2ForCausalLM(CausalLM):
    """Gemma decoder layers of the family's ``attention`` class; Llama's merged projections
    and checkpoint names. The attention scale and the score soft-capping reach the backend
    from the config (:attr:`ModelConfig.attention_scale`, ``attn_logit_softcapping``)."""

    attention: ClassVar[type[Attention]] = Attention

    stacked_params = MERGED_PROJECTIONS

    def __init__(
        self,
        config: ModelConfig,
        linear_method: LinearMethod | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(config, linear_method, tp)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)  # type: ignore[assignment]

    def build_layer(
        self,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None,
        tp: TPGroup | None,
    ) -> nn.Module:
        return GemmaDecoderLayer(self.config, layer_id, rotary, method, tp, self.attention)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(ids)
        # NOTE: transformers rounds sqrt(hidden_size) to the model dtype before the product
        normalizer = torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype).item()
        return hidden * normalizer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied head's float32 logits, soft-capped by ``final_logit_softcapping``."""
        return softcap_ref(super().compute_logits(hidden), self.config.final_logit_softcapping)
