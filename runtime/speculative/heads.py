"""Start-up checks of an EAGLE draft head against its target, from their configs only
(no weights, no torch): run before any process starts and again when the head loads."""

from __future__ import annotations

from pathlib import Path

from kvflow.runtime.config import EngineConfig, ModelConfig
from kvflow.runtime.models import EAGLE_HEADS, resolve_model_path

__all__ = ["check_draft_model"]


def check_draft_model(config: EngineConfig, target: ModelConfig) -> Path | None:
    """The EAGLE head's folder (or, for dummy weights, config file); None for the other
    algorithms. Raises ValueError (one line) for a missing path, a checkpoint that is not
    an EAGLE-1/2 head, or one whose hidden or vocabulary size is not the target's."""
    if config.speculative_algorithm != "EAGLE":
        return None
    path = config.speculative_draft_model_path
    if not path:
        raise ValueError("--speculative-algorithm EAGLE needs --speculative-draft-model-path")
    flag = f"--speculative-draft-model-path {path}"
    try:
        folder = resolve_model_path(path, config.load_format)
    except FileNotFoundError as err:
        raise ValueError(f"{flag}: {err}") from err
    head = ModelConfig.from_path(folder)
    if head.architecture not in EAGLE_HEADS:
        raise ValueError(
            f"{flag}: {head.architecture} is not an EAGLE head ({', '.join(EAGLE_HEADS)}); "
            "EAGLE-3 heads are not built"
        )
    for what, theirs, ours in (
        ("hidden_size", head.hidden_size, target.hidden_size),
        ("vocab_size", head.vocab_size, target.vocab_size),
    ):
        if theirs != ours:
            raise ValueError(f"{flag}: the head's {what} is {theirs}, the target's {ours}")
    return folder
