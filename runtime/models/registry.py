"""Which checkpoints this runtime serves: the architectures in :data:`MODELS`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.runtime.utils import Registry

if TYPE_CHECKING:
    from kvflow.runtime.models.causal_lm import CausalLM

__all__ = ["MODELS"]

MODELS: Registry[CausalLM] = Registry("model architecture")
for _arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
    MODELS.register(_arch, "kvflow.runtime.models.llama:LlamaForCausalLM")
MODELS.register("Qwen3ForCausalLM", "kvflow.runtime.models.qwen3:Qwen3ForCausalLM")
