"""Multi-LoRA serving (SGLang's interface): adapters in PEFT's format held in host memory,
a fixed number of device slots (LRU), and every targeted projection adding its requests'
deltas through segmented matmuls (``kvflow.kernels.lora``) in mixed batches."""

from typing import TYPE_CHECKING

from kvflow.lazy import lazy_exports
from kvflow.runtime.lora.options import LoraOptions, parse_lora_paths
from kvflow.runtime.lora.slots import LoraSlots, SlotPlan
from kvflow.runtime.lora.targets import LORA_TARGETS, LoraTarget, resolve_target_modules

if TYPE_CHECKING:
    from kvflow.runtime.lora.adapter import LoraAdapter, LoraLimits, load_adapter
    from kvflow.runtime.lora.batch import LoraBatch
    from kvflow.runtime.lora.graph import LoraGraphInputs
    from kvflow.runtime.lora.layers import LoraContext, LoraLinear
    from kvflow.runtime.lora.manager import LoraManager
else:  # torch-free until a name is used (kvflow.lazy)
    __getattr__ = lazy_exports(
        __name__,
        {
            ".adapter": ("LoraAdapter", "LoraLimits", "load_adapter"),
            ".batch": ("LoraBatch",),
            ".graph": ("LoraGraphInputs",),
            ".layers": ("LoraContext", "LoraLinear"),
            ".manager": ("LoraManager",),
        },
    )

__all__ = [
    "LORA_TARGETS",
    "LoraAdapter",
    "LoraBatch",
    "LoraContext",
    "LoraGraphInputs",
    "LoraLimits",
    "LoraLinear",
    "LoraManager",
    "LoraOptions",
    "LoraSlots",
    "LoraTarget",
    "SlotPlan",
    "load_adapter",
    "parse_lora_paths",
    "resolve_target_modules",
]
