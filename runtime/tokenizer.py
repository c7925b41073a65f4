"""Loading the model's tokenizer and applying its chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["apply_chat_template", "load_tokenizer"]


def load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    folder = model_path if model_path.is_dir() else model_path.parent
    return AutoTokenizer.from_pretrained(str(folder))


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """Token ids of a chat, with the generation prompt appended."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, **kwargs
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
