"""Which projections an adapter may target, and where each lands in kvflow's merged layers.

PEFT names the Hugging Face projections (``q_proj``, ``gate_proj``...); kvflow merges
q/k/v into ``self_attn.qkv_proj`` and gate/up into ``mlp.gate_up_proj``. A target is one
shard of one of those layers.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["LORA_TARGETS", "LoraTarget", "resolve_target_modules"]


class LoraTarget(NamedTuple):
    """A PEFT module's place: the layer (a path under a decoder layer) and its shard."""

    layer: str
    shard: int


LORA_TARGETS: dict[str, LoraTarget] = {
    "q_proj": LoraTarget("self_attn.qkv_proj", 0),
    "k_proj": LoraTarget("self_attn.qkv_proj", 1),
    "v_proj": LoraTarget("self_attn.qkv_proj", 2),
    "o_proj": LoraTarget("self_attn.o_proj", 0),
    "gate_proj": LoraTarget("mlp.gate_up_proj", 0),
    "up_proj": LoraTarget("mlp.gate_up_proj", 1),
    "down_proj": LoraTarget("mlp.down_proj", 0),
}
# SGLang's --lora-target-modules also takes these names for the merged layers
_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def resolve_target_modules(names: tuple[str, ...]) -> frozenset[str]:
    """PEFT module names of ``--lora-target-modules`` (``all``: every one); raises
    ValueError naming an unsupported one."""
    if "all" in names:
        return frozenset(LORA_TARGETS)
    resolved: set[str] = set()
    for name in names:
        if name in _MERGED:
            resolved.update(_MERGED[name])
        elif name in LORA_TARGETS:
            resolved.add(name)
        else:
            raise ValueError(
                f"LoRA target module {name!r} is not supported; kvflow applies adapters to "
                f"{', '.join(LORA_TARGETS)} (or 'all')"
            )
    return frozenset(resolved)
