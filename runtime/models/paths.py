"""Where a model's config is: a Hugging Face folder, a dummy model's config file, or the
embedded model's converted folder (converted on first use)."""

from __future__ import annotations

from pathlib import Path

from kvflow.runtime.config import DUMMY_CONFIGS
from kvflow.runtime.models.embedded import embedded_model_path

__all__ = ["resolve_model_path"]


def resolve_model_path(model_path: str | None, load_format: str) -> Path:
    """A folder (or, for dummy weights, a config file) holding the model's config."""
    if not model_path:
        return embedded_model_path()
    if load_format == "dummy" and model_path in DUMMY_CONFIGS:
        return DUMMY_CONFIGS[model_path]
    path = Path(model_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {model_path!r} does not exist (and no model hub is used)"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
    return path
