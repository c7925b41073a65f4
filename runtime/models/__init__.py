"""Native model implementations, chosen by the checkpoint's ``architectures`` entry.

A family is one module here (``llama.py``, ``qwen3.py``, ``mixtral.py``, ``qwen3_moe.py``,
``gemma2.py``, ``gemma3.py``): a
:class:`~kvflow.runtime.models.causal_lm.CausalLM` built from the shared blocks in
``blocks.py``, registered in ``registry.py`` under each architecture name it serves.
"""

from __future__ import annotations

from kvflow.runtime.models.embedded import EMBEDDED_MODEL_NAME, embedded_model_path
from kvflow.runtime.models.paths import resolve_model_path
from kvflow.runtime.models.registry import EAGLE_HEADS, MODELS, ROPE_TYPES, check_supported

__all__ = [
    "EAGLE_HEADS",
    "EMBEDDED_MODEL_NAME",
    "MODELS",
    "ROPE_TYPES",
    "check_supported",
    "embedded_model_path",
    "resolve_model_path",
]
