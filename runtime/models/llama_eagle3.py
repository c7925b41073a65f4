"""EAGLE-3 draft head for Llama-shaped targets (SGLang's ``LlamaForCausalLMEagle3``).

The checkpoint holds ``fc`` (``3 * hidden -> hidden``, over the inputs of three target
layers, concatenated), one ``midlayer`` (a Llama decoder layer whose attention reads
``concat(input_layernorm(embed(token)), hidden_norm(feature))``, ``2 * hidden`` wide), a
final ``norm`` and, with ``draft_vocab_size`` in its config, its own ``lm_head`` over a
reduced vocabulary with ``d2t`` (draft id -> target id offsets). Without
``draft_vocab_size`` the target's LM head is used. The token embedding is the target's.
The head's output before its final norm is the next step's feature; the norm and the LM
head make the draft token.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvflow.runtime.attention import AttentionBackend
from kvflow.runtime.config import ModelConfig
from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.layers import (
    LinearMethod,
    ParallelLMHead,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    gather_logits,
)
from kvflow.runtime.models.blocks import DecoderLayer
from kvflow.runtime.models.causal_lm import CausalLM
from kvflow.runtime.models.llama import LlamaForCausalLM
from kvflow.runtime.models.llama_eagle import LlamaEagleHead

__all__ = ["LlamaEagle3Head"]

_SKIPPED = ("embed_tokens.weight", "t2d")


class Eagle3MidLayer(DecoderLayer):
    """SGLang's EAGLE-3 ``midlayer``: attention over ``concat(input_layernorm(embeds),
    hidden_norm(hidden))`` (``2 * hidden`` wide), then the MLP; residual: ``hidden``."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(config, layer_id, rotary, method, tp)
        self.self_attn.qkv_proj = QKVLinear(
            2 * config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            config.attention_bias,
            method,
            tp,
        )
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward_eagle3(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        fb: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """The layer's output plus its residual (before the head's final norm)."""
        both = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        out = self.self_attn(positions, both, fb, attn)
        out, residual = self.post_attention_layernorm(out, hidden)
        return self.mlp(out) + residual


class LlamaEagle3Head(LlamaEagleHead):
    """``forward`` reads ``fb.input_hidden``: ``[N, 3 * hidden]`` target states (through
    ``fc``) or ``[N, hidden]`` outputs of its own, and returns ``[N, hidden]`` before its
    final norm; :meth:`draft_ids` makes target token ids of them."""

    def __init__(
        self,
        config: ModelConfig,
        linear_method: LinearMethod | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        LlamaForCausalLM.__init__(self, config, linear_method, tp)
        del self.embed_tokens
        hidden = config.hidden_size
        self.fc = nn.Linear(3 * hidden, hidden, bias=config.fc_bias)
        self.draft_vocab_size = config.draft_vocab_size
        self.lm_head = (
            None
            if self.draft_vocab_size is None
            else ParallelLMHead(hidden, self.draft_vocab_size, tp=tp)
        )
        self.hot_token_id: torch.Tensor | None = None  # draft id -> target id
        self._target: list[CausalLM] = []  # the target (not a submodule), as the EAGLE head

    def build_layer(
        self,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None,
        tp: TPGroup | None,
    ) -> nn.Module:
        return Eagle3MidLayer(self.config, layer_id, rotary, method, tp)

    def forward(self, fb: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        assert fb.input_hidden is not None, "an EAGLE head needs the features of its tokens"
        dtype = self.fc.weight.dtype
        embeds = self._target[0].embed_tokens(fb.input_ids).to(dtype)
        hidden = fb.input_hidden.to(dtype)
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden)
        layer = self.layers[0]
        assert isinstance(layer, Eagle3MidLayer)
        return layer.forward_eagle3(fb.positions, embeds, hidden, fb, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the head's vocabulary (the target's without ``draft_vocab_size``)."""
        normed: torch.Tensor = self.norm(hidden)  # type: ignore[assignment]
        if self.lm_head is None:
            return super().compute_logits(normed)
        assert self.draft_vocab_size is not None
        return gather_logits(self.lm_head(normed), self.tp, self.draft_vocab_size).float()

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Through ``d2t`` (:attr:`hot_token_id`) when the head has its own vocabulary."""
        return ids if self.hot_token_id is None else self.hot_token_id[ids]

    def process_weights_after_loading(self, tied_head: object = None) -> None:
        super().process_weights_after_loading()
        if self.lm_head is not None:
            self.lm_head.process_weights_after_loading()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """SGLang's EAGLE-3 names (``midlayer.*`` is our ``layers.0.*``); ``d2t`` becomes
        :attr:`hot_token_id`, ``t2d`` and the embedding are not used."""
        kept: list[tuple[str, torch.Tensor]] = []
        d2t: torch.Tensor | None = None
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name == "d2t":
                d2t = tensor
            elif name not in _SKIPPED and not (name == "lm_head.weight" and self.lm_head is None):
                kept.append((name.replace("midlayer.", "layers.0.", 1), tensor))
        LlamaForCausalLM.load_weights(self, kept)
        if self.draft_vocab_size is not None:
            if d2t is None or d2t.shape != (self.draft_vocab_size,):
                raise KeyError("an EAGLE-3 head with draft_vocab_size needs d2t of that size")
            device = self.norm.weight.device
            self.hot_token_id = (d2t.long() + torch.arange(d2t.shape[0])).to(device)
