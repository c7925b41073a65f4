"""Native model implementations, chosen by the checkpoint's ``architectures`` entry.

A family is one module here (``llama.py``): a :class:`~kvflow.runtime.models.causal_lm.CausalLM`
built from the shared blocks in ``blocks.py``, registered below under each architecture
name it serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.runtime.models.embedded import EMBEDDED_MODEL_NAME, embedded_model_path
from kvflow.runtime.utils import Registry

if TYPE_CHECKING:
    from kvflow.runtime.models.causal_lm import CausalLM

__all__ = ["EMBEDDED_MODEL_NAME", "MODELS", "embedded_model_path"]

MODELS: Registry[CausalLM] = Registry("model architecture")
for _arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
    MODELS.register(_arch, "kvflow.runtime.models.llama:LlamaForCausalLM")
