"""Which checkpoints this runtime serves: the architectures in :data:`MODELS`, the RoPE
types the rotary layer builds, full attention only; :func:`check_supported` says so before
any process starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.runtime.config import ModelConfig
from kvflow.runtime.utils import Registry

if TYPE_CHECKING:
    from kvflow.runtime.models.causal_lm import CausalLM

__all__ = ["MODELS", "ROPE_TYPES", "check_supported"]

MODELS: Registry[CausalLM] = Registry("model architecture")
for _arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
    MODELS.register(_arch, "kvflow.runtime.models.llama:LlamaForCausalLM")
MODELS.register("Qwen3ForCausalLM", "kvflow.runtime.models.qwen3:Qwen3ForCausalLM")
MODELS.register("MixtralForCausalLM", "kvflow.runtime.models.mixtral:MixtralForCausalLM")
MODELS.register("Qwen3MoeForCausalLM", "kvflow.runtime.models.qwen3_moe:Qwen3MoeForCausalLM")

# rope_type values kvflow.runtime.layers.RotaryEmbedding builds (tests keep them in step)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def check_supported(config: ModelConfig, context_length: int | None = None) -> None:
    """Raise ValueError (one line) if this runtime cannot serve ``config`` at
    ``context_length`` (None: the model's own): an architecture not in :data:`MODELS`, a
    RoPE type not in :data:`ROPE_TYPES`, or a sliding attention window shorter than the
    context served (sliding windows are not implemented; within the window, full
    attention is exact)."""
    arch, supported = config.architecture, ", ".join(MODELS.choices())
    if arch not in MODELS.choices():
        raise ValueError(f"model architecture {arch!r} is not supported; supported: {supported}")
    if config.rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{arch} uses rope_type {config.rope_type!r}, which is not supported; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    longest = config.max_position_embeddings
    served = min(context_length or longest, longest)
    window = config.sliding_window
    if window is not None and window < served:
        raise ValueError(
            f"{arch} slides its attention over a {window}-token window (sliding_window), "
            f"which kvflow does not implement, and would serve {served} tokens; pass "
            f"--context-length {window} or less (full attention is then exact)"
        )
