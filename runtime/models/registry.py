"""Which checkpoints this runtime serves: the architectures in :data:`MODELS` and the RoPE
types the rotary layer builds (full or sliding-window attention, per layer);
:func:`check_supported` says so before any process starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.runtime.config import ModelConfig
from kvflow.runtime.utils import Registry

if TYPE_CHECKING:
    from kvflow.runtime.models.causal_lm import CausalLM

__all__ = ["EAGLE_HEADS", "MODELS", "ROPE_TYPES", "check_supported"]

MODELS: Registry[CausalLM] = Registry("model architecture")
for _arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
    MODELS.register(_arch, "kvflow.runtime.models.llama:LlamaForCausalLM")
MODELS.register("Qwen3ForCausalLM", "kvflow.runtime.models.qwen3:Qwen3ForCausalLM")
MODELS.register("MixtralForCausalLM", "kvflow.runtime.models.mixtral:MixtralForCausalLM")
MODELS.register("Qwen3MoeForCausalLM", "kvflow.runtime.models.qwen3_moe:Qwen3MoeForCausalLM")
MODELS.register("Gemma2ForCausalLM", "kvflow.runtime.models.gemma2:Gemma2ForCausalLM")
MODELS.register("Gemma3ForCausalLM", "kvflow.runtime.models.gemma3:Gemma3ForCausalLM")
# EAGLE draft heads (algorithm -> architectures): loaded only as the
# --speculative-draft-model-path of a target run with that --speculative-algorithm
EAGLE_HEADS = {"EAGLE": ("LlamaForCausalLMEagle",), "EAGLE3": ("LlamaForCausalLMEagle3",)}
MODELS.register("LlamaForCausalLMEagle", "kvflow.runtime.models.llama_eagle:LlamaEagleHead")
MODELS.register("LlamaForCausalLMEagle3", "kvflow.runtime.models.llama_eagle3:LlamaEagle3Head")
_HEAD_ARCHS = {arch for archs in EAGLE_HEADS.values() for arch in archs}

# Gemma's MLP activation (transformers' hidden_activation), the only one its module builds
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
# NOTE: transformers' Gemma 3 reads attn_logit_softcapping but never applies it (and the
# released configs set none), so a config that sets it has no reference to match.
GEMMA3_SOFTCAP = (
    "Gemma3ForCausalLM with attn_logit_softcapping is not supported "
    "(transformers' Gemma 3 does not apply it; the released configs set none)"
)

# rope_type values kvflow.runtime.layers.RotaryEmbedding builds (tests keep them in step)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def check_supported(config: ModelConfig, context_length: int | None = None) -> None:
    """Raise ValueError (one line) if this runtime cannot serve ``config`` at
    ``context_length`` (None: the model's own): an architecture not in :data:`MODELS` or a
    RoPE type not in :data:`ROPE_TYPES`, a Gemma activation other than GeGLU's tanh GELU,
    a Gemma 3 with attention soft-capping.
    Sliding attention windows are served, per layer (:meth:`ModelConfig.layer_window`), by
    every attention backend, and so is soft-capping of the attention scores."""
    arch = config.architecture
    supported = ", ".join(a for a in MODELS.choices() if a not in _HEAD_ARCHS)
    if arch not in MODELS.choices():
        raise ValueError(f"model architecture {arch!r} is not supported; supported: {supported}")
    if arch in _HEAD_ARCHS:
        algorithm = next(a for a, archs in EAGLE_HEADS.items() if arch in archs)
        raise ValueError(
            f"{arch} is an EAGLE draft head, not a model to serve: serve its target with "
            f"--speculative-algorithm {algorithm} --speculative-draft-model-path <this folder>"
        )
    if config.rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{arch} uses rope_type {config.rope_type!r}, which is not supported; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    if arch == "Gemma3ForCausalLM" and config.attn_logit_softcapping is not None:
        raise ValueError(GEMMA3_SOFTCAP)
    if arch.startswith("Gemma") and config.hidden_act not in GEMMA_ACTIVATIONS:
        raise ValueError(
            f"{arch} uses hidden_activation {config.hidden_act!r}, which is not supported; "
            f"supported: {', '.join(GEMMA_ACTIVATIONS)}"
        )
