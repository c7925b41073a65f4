"""Gemma 3 (text): Gemma 2's layers and head, with Gemma's RMSNorm over each head of q and
k before rotary, five local sliding-window layers to one global (``layer_types``), and two
RoPE tables: the local layers rotate with base ``rope_local_base_freq`` and no scaling, the
global ones with ``rope_theta`` and ``rope_scaling`` (linear, factor 8, in the released
checkpoints). The final logits are soft-capped where the config says so (as transformers
does); attention soft-capping is refused (transformers' Gemma 3 never applies it)."""

from __future__ import annotations

from kvflow.runtime.config import ModelConfig
from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.layers import GemmaRMSNorm, LinearMethod, RotaryEmbedding
from kvflow.runtime.models.blocks import QKNormAttention
from kvflow.runtime.models.gemma2 import Gemma2ForCausalLM, GemmaDecoderLayer
from kvflow.runtime.models.registry import GEMMA3_SOFTCAP

__all__ = ["Gemma3ForCausalLM"]

# transformers' base of the local layers when a config names none
DEFAULT_LOCAL_BASE = 10_000.0


class GemmaQKNormAttention(QKNormAttention):
    """Gemma 3's attention: q and k normed per head by a :class:`GemmaRMSNorm`."""

    qk_norm = GemmaRMSNorm


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's model with ``self_attn.q_norm`` / ``k_norm`` in every layer, and the local
    RoPE table in the sliding layers."""

    attention = GemmaQKNormAttention

    def __init__(
        self,
        config: ModelConfig,
        linear_method: LinearMethod | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        if config.attn_logit_softcapping is not None:  # the runner would cap the backend
            raise ValueError(GEMMA3_SOFTCAP)
        super().__init__(config, linear_method, tp)

    def build_layer(
        self,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None,
        tp: TPGroup | None,
    ) -> GemmaDecoderLayer:
        config = self.config
        if config.layer_window(layer_id) is not None:
            if not hasattr(self, "local_rotary"):  # one table, shared by the local layers
                base = config.rope_local_base_freq or DEFAULT_LOCAL_BASE
                self.local_rotary = RotaryEmbedding(
                    config.head_dim, config.max_position_embeddings, base, None
                )
            rotary = self.local_rotary
        return GemmaDecoderLayer(config, layer_id, rotary, method, tp, self.attention)
