"""SGLang's LoRA flags as the engine holds them, and ``--lora-paths`` parsed: what the HTTP
process checks and reads without torch."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LoraOptions", "parse_lora_paths"]


@dataclass(frozen=True)
class LoraOptions:
    """SGLang's LoRA flags, as :class:`~kvflow.runtime.config.EngineConfig` holds them.
    ``max_lora_rank`` 0 and empty ``lora_target_modules``: inferred from the start-up
    adapters (the largest rank, every module they target)."""

    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 8
    max_lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = ()


def parse_lora_paths(entries: Sequence[str]) -> list[tuple[str, str]]:
    """SGLang's ``--lora-paths`` entries, ``name=path``, a bare path (named by itself) or
    a JSON object ``{"lora_name": ..., "lora_path": ...}``, as (name, path); raises
    ValueError on an empty part or a repeated name."""
    pairs: list[tuple[str, str]] = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if entry.lstrip().startswith("{"):
            try:
                spec = json.loads(entry)
                name, path = str(spec["lora_name"]), str(spec["lora_path"])
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"--lora-paths {entry!r}: not SGLang's JSON entry") from err
        elif not sep:
            name = path = entry
        if not name or not path:
            raise ValueError(f"--lora-paths {entry!r}: expected NAME=PATH or PATH")
        if any(name == seen for seen, _ in pairs):
            raise ValueError(f"--lora-paths names adapter {name!r} twice")
        pairs.append((name, path))
    return pairs
