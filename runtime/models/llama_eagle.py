"""EAGLE-1/2 draft head for Llama-shaped targets (SGLang's ``LlamaForCausalLMEagle``).

The checkpoint holds ``fc`` (``2 * hidden -> hidden``, over ``concat(embed(token),
feature)``) and one or more Llama decoder layers (``layers.{i}.*``; layer 0 has no input
norm). The token embedding and the LM head are the target's (:meth:`share_target`): a
checkpoint's own ``embed_tokens`` / ``lm_head`` are skipped, as SGLang replaces them.
There is no final norm: the head's output (the last layer's output plus its residual) is
both the next step's feature and what the target's LM head reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvflow.runtime.attention import AttentionBackend
from kvflow.runtime.config import ModelConfig
from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.layers import LinearBase, LinearMethod
from kvflow.runtime.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from kvflow.runtime.models.causal_lm import CausalLM

__all__ = ["LlamaEagleHead"]

# checkpoint tensors the head does not use: the target's embedding and head replace them,
# and layer 0 runs without its input norm (SGLang drops it the same way)
_SKIPPED = ("embed_tokens.weight", "lm_head.weight", "layers.0.input_layernorm.weight")


class LlamaEagleHead(LlamaForCausalLM):
    """``forward`` reads the features of its input tokens from ``fb.input_hidden``
    (``[N, hidden]``: the target's final-norm hidden state at the position before each
    token, or the head's own output for drafted tokens) and returns ``[N, hidden]``."""

    def __init__(
        self,
        config: ModelConfig,
        linear_method: LinearMethod | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(config, linear_method, tp)
        del self.embed_tokens, self.norm, self.lm_head
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.layers[0].input_layernorm = nn.Identity()
        self._target: list[CausalLM] = []  # a list: not a submodule (its weights are not ours)

    def share_target(self, target: CausalLM) -> None:
        """Use ``target``'s token embedding and LM head (before the first forward)."""
        self._target[:] = [target]

    def forward(self, fb: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        assert fb.input_hidden is not None, "an EAGLE head needs the features of its tokens"
        dtype = self.fc.weight.dtype  # the target's may differ (--dtype auto per checkpoint)
        embeds = self._target[0].embed_tokens(fb.input_ids).to(dtype)
        hidden = self.fc(torch.cat((embeds, fb.input_hidden.to(dtype)), dim=-1))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(fb.positions, hidden, residual, fb, attn)
        assert residual is not None
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on the head's output (no final norm, as SGLang's)."""
        target = self._target[0]
        return target.compute_logits(hidden.to(target.norm.weight.dtype))

    def draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft token (a target id) after each row of the head's output."""
        return self.target_ids(self.compute_logits(hidden).argmax(dim=-1))

    def draft_topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's ``k`` likeliest tokens after each row of its output, best first:
        their probabilities (softmax over the head's logits) and their target ids,
        ``[R, k]`` each (a draft tree's step, as SGLang's ``fast_topk``)."""
        probs = torch.softmax(self.compute_logits(hidden).float(), dim=-1)
        top = probs.topk(k, dim=-1)
        return top.values, self.target_ids(top.indices)

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids of ids in the head's vocabulary (the same here)."""
        return ids

    def process_weights_after_loading(self, tied_head: object = None) -> None:
        for module in self.layers.modules():
            if isinstance(module, LinearBase):
                module.process_weights_after_loading()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """SGLang's EAGLE names (``fc.*``, ``layers.*``, with or without ``model.``); a
        checkpoint without ``fc.bias`` gets a zero bias (EAGLE's ``fc`` may have none)."""
        kept: list[tuple[str, torch.Tensor]] = []
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name not in _SKIPPED:
                kept.append((name, tensor))
        if not any(name == "fc.bias" for name, _ in kept):
            kept.append(("fc.bias", torch.zeros(self.config.hidden_size)))
        super().load_weights(kept)
