"""Which LoRA adapters a request asks for, read as the workers read it (SGLang's forms).

- ``lora_path`` (``/generate``, and the OpenAI routes, where it wins over ``model``): an
  adapter's name, or a list with one per prompt (``null``: the base model);
- OpenAI ``model``: ``base:adapter``, or an adapter's own name (one of ``known``); any other
  name is the base model.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

__all__ = ["adapter_key", "requested_adapters"]

_OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")


def requested_adapters(
    route: str, payload: dict[str, Any], known: Container[str]
) -> frozenset[str]:
    """The adapters ``payload`` names (empty: the base model only)."""
    lora = payload.get("lora_path")
    if isinstance(lora, str):
        return frozenset({lora})
    if isinstance(lora, list):
        return frozenset(name for name in lora if isinstance(name, str))
    model = payload.get("model")
    if route not in _OPENAI_ROUTES or not isinstance(model, str):
        return frozenset()
    if model in known:
        return frozenset({model})
    _, sep, adapter = model.partition(":")
    return frozenset({adapter}) if sep and adapter else frozenset()


def adapter_key(adapters: frozenset[str], key: str) -> str:
    """The routing key within ``adapters``: prefixes of one adapter never match another's
    (nor the base model's) in the cache-aware trees, as the workers' radix caches keep
    them apart too."""
    if not adapters or not key:
        return key
    return "\x01" + "\x02".join(sorted(adapters)) + "\x01" + key
