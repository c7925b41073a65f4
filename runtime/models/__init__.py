"""Native model implementations, chosen by the checkpoint's ``architectures`` entry."""

from kvflow.runtime.models.embedded import EMBEDDED_MODEL_NAME, embedded_model_path
from kvflow.runtime.utils import Registry

__all__ = ["EMBEDDED_MODEL_NAME", "MODELS", "embedded_model_path"]

MODELS: Registry = Registry("model architecture")
for _arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
    MODELS.register(_arch, "kvflow.runtime.models.llama:LlamaForCausalLM")
