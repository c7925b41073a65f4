"""Native model implementations, chosen by the checkpoint's ``architectures`` entry.

A family is one module here (``llama.py``, ``qwen3.py``, ``mixtral.py``, ``qwen3_moe.py``,
``gemma2.py``, ``gemma3.py``): a
:class:`~kvflow.runtime.models.causal_lm.CausalLM` built from the shared blocks in
``blocks.py``, registered in ``registry.py`` under each architecture name it serves.
EAGLE draft heads (``llama_eagle.py``, ``llama_eagle3.py``) are registered there too but
only load as a target's draft; ``eagle_heads.py`` checks a head against its target.
"""

from __future__ import annotations

from kvflow.runtime.models.eagle_heads import FeatureSpec, check_draft_model, target_features
from kvflow.runtime.models.embedded import EMBEDDED_MODEL_NAME, embedded_model_path
from kvflow.runtime.models.paths import resolve_model_path
from kvflow.runtime.models.registry import EAGLE_HEADS, MODELS, ROPE_TYPES, check_supported

__all__ = [
    "EAGLE_HEADS",
    "EMBEDDED_MODEL_NAME",
    "MODELS",
    "ROPE_TYPES",
    "FeatureSpec",
    "check_draft_model",
    "check_supported",
    "embedded_model_path",
    "resolve_model_path",
    "target_features",
]
