"""Loading the model's tokenizer and applying its chat template."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "TokenBytes",
    "apply_chat_template",
    "load_chat_template",
    "load_decoder",
    "load_tokenizer",
    "tokenizer_folder",
]


def tokenizer_folder(
    tokenizer_path: str | None, skip_tokenizer_init: bool, model_path: Path
) -> Path | None:
    """Where the tokenizer is loaded from: ``tokenizer_path`` when given, else the model's
    folder (its config file's folder for a config file); None with ``skip_tokenizer_init``."""
    if skip_tokenizer_init:
        return None
    if tokenizer_path:
        return Path(tokenizer_path).expanduser()
    return model_path if model_path.is_dir() else model_path.parent


# tokenizer_config.json classes whose transformers decode is the tokenizer.json's own
_PLAIN_FAST_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# config.json model types for which transformers 5's AutoTokenizer loads a plain fast
# tokenizer_config class as TokenizersBackend, nothing model-specific
# (tests/runtime/test_tokenizer_decoder.py holds the two loads equal)
_PLAIN_MODEL_TYPES = frozenset({"llama"})


def load_tokenizer(model_path: Path) -> Any:
    """transformers' tokenizer of a model folder, as ``AutoTokenizer`` loads it.

    NOTE: ``AutoTokenizer`` first reads the model's config through ``AutoConfig``, whose
    imports take torch and torch.distributed (2.5 s of the HTTP process's start on 2
    cores); where it would load a plain fast tokenizer (:func:`_plain_fast`), transformers
    5's ``TokenizersBackend`` loads it directly, in 0.8 s without torch."""
    folder = model_path if model_path.is_dir() else model_path.parent
    if _plain_fast(folder):
        try:
            from transformers import TokenizersBackend
        except ImportError:  # transformers 4: AutoTokenizer decides
            pass
        else:
            return TokenizersBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _plain_fast(folder: Path) -> bool:
    """Whether the folder's tokenizer is a plain fast one (tokenizer.json, a plain class in
    tokenizer_config.json, no custom code) of a model type AutoTokenizer gives no class
    of its own."""
    import json

    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        model = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        config.get("tokenizer_class") in _PLAIN_FAST_CLASSES
        and "auto_map" not in config
        and model.get("model_type") in _PLAIN_MODEL_TYPES
        and "auto_map" not in model
        and (folder / "tokenizer.json").is_file()
    )


def load_decoder(model_path: Path) -> Any:
    """What turns ids into text (``decode(ids, skip_special_tokens=...)``), for processes
    that only decode (the detokenizer): the folder's ``tokenizer.json`` through the
    ``tokenizers`` library where transformers' decode is exactly that one (a plain fast
    tokenizer class, no clean-up of tokenization spaces), else :func:`load_tokenizer`.

    NOTE: ``tokenizers`` loads in 0.1 s without torch; transformers imports torch and
    takes 2-5 s on 2 cores, all start-up time of a process that needs neither."""
    import json

    folder = model_path if model_path.is_dir() else model_path.parent
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    plain = config.get("tokenizer_class") in _PLAIN_FAST_CLASSES
    if (
        plain
        and not config.get("clean_up_tokenization_spaces")
        and (folder / "tokenizer.json").is_file()
    ):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    return load_tokenizer(folder)


def load_chat_template(path: str) -> str:
    """A ``--chat-template`` Jinja file's template, read as SGLang reads it (outer newlines
    stripped, a literal ``\\n`` taken as a newline)."""
    return Path(path).expanduser().read_text().strip("\n").replace("\\n", "\n")


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> list[int]:
    """Token ids of a chat, with the generation prompt appended (by default), or ending
    inside the final message, which the model is to continue (``continue_final_message``:
    transformers renders the chat and cuts it right after that message's text)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=True,
        **kwargs,
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


class TokenBytes:
    """The bytes a token stands for, also when they are only part of a UTF-8 character
    (decoding such a token alone gives the replacement character, whose bytes are wrong)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.of = lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        text = self.tokenizer.decode([token_id])
        if "\ufffd" not in text:
            return text.encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if match := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        if all(char in _BYTE_LEVEL for char in piece):
            return bytes(_BYTE_LEVEL[char] for char in piece)
        return text.encode()  # a token that really decodes to U+FFFD
