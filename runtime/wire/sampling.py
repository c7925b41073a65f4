"""Sampling parameters of one request, validated once when the request arrives."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GRAMMAR_FIELDS",
    "LOGIT_BIAS_LIMIT",
    "SEED_RANGE",
    "TEMPERATURE_FLOOR",
    "SamplingParams",
]

# Below this temperature sampling is greedy (dividing logits by it would overflow softmax).
TEMPERATURE_FLOOR = 1e-5
# Seeds are 64-bit integers, signed or unsigned, as torch and OpenAI clients use them.
SEED_RANGE = (-(1 << 63), 1 << 64)

_TYPES: dict[str, tuple[type, ...]] = {
    "max_new_tokens": (int,),
    "min_new_tokens": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "min_p": (int, float),
    "frequency_penalty": (int, float),
    "presence_penalty": (int, float),
    "repetition_penalty": (int, float),
    "stop": (str, list, tuple),
    "stop_token_ids": (list, tuple),
    "ignore_eos": (bool,),
    "skip_special_tokens": (bool,),
    "seed": (int,),
    "n": (int,),
    # structured output (SGLang's names; at most one; json_schema is a JSON string)
    "json_schema": (str,),
    "regex": (str,),
    "ebnf": (str,),
    "structural_tag": (str,),
    "logit_bias": (dict,),  # OpenAI's: token id (string or int) -> bias in [-100, 100]
}
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
LOGIT_BIAS_LIMIT = 100.0
# The parameter names :meth:`SamplingParams.from_dict` takes.
SAMPLING_KEYS = frozenset(_TYPES)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    A temperature below :data:`TEMPERATURE_FLOOR` (or ``top_k == 1``) is greedy. ``top_k == -1`` disables top-k.
    Penalties follow OpenAI (frequency/presence, on generated tokens) and Hugging Face
    (repetition, on prompt and generated tokens). ``min_new_tokens`` suppresses EOS,
    stop tokens and stop strings until that many tokens exist. ``seed`` makes sampling
    reproducible for the request regardless of what else is in the batch.

    ``json_schema``, ``regex``, ``ebnf`` and ``structural_tag`` constrain the output to a
    grammar (see ``kvflow.runtime.grammar``, which checks and compiles it; this module only
    checks that at most one is set). ``logit_bias`` adds its bias to each named token's
    logit before sampling, as pairs ``(token_id, bias)``.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> SamplingParams:
        """Build from user input; unknown keys and wrong types raise ``ValueError``."""
        raw = dict(raw or {})
        unknown = sorted(set(raw) - set(_TYPES))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if value is None:
                continue
            if isinstance(value, bool) and bool not in _TYPES[key]:
                raise ValueError(f"{key} must be a number, got a boolean")
            if not isinstance(value, _TYPES[key]):
                raise ValueError(f"{key} has the wrong type {type(value).__name__}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{key} must be a finite number, got {value}")
            values[key] = value
        if isinstance(values.get("stop"), str):
            values["stop"] = (values["stop"],)
        for key in ("stop", "stop_token_ids"):
            if key in values:
                values[key] = tuple(values[key])
        if "logit_bias" in values:
            values["logit_bias"] = _logit_bias_pairs(values["logit_bias"])
        params = cls(**values)
        params.validate()
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        floats = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        for key, value in floats.items():
            if not math.isfinite(value):
                raise ValueError(f"{key} must be a finite number, got {value}")
        low, high = SEED_RANGE
        checks = [
            (self.seed is None or low <= self.seed < high, "seed must be a 64-bit integer"),
            (self.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
            (0 <= self.min_new_tokens < 1 << 31, "min_new_tokens must be in [0, 2**31)"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (
                self.top_k == -1 or 1 <= self.top_k < 1 << 31,
                "top_k must be -1 (disabled) or in [1, 2**31)",
            ),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (0 < self.repetition_penalty <= 2, "repetition_penalty must be in (0, 2]"),
            (1 <= self.n <= 128, "n must be in [1, 128]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (len(self.stop) <= 16, "at most 16 stop strings"),
            (
                all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids),
                "stop_token_ids must be integers",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
        grammars = [f for f in GRAMMAR_FIELDS if getattr(self, f) is not None]
        if len(grammars) > 1:
            raise ValueError(
                f"give at most one of {', '.join(GRAMMAR_FIELDS)} (got {', '.join(grammars)})"
            )
        for token, bias in self.logit_bias:
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias of token {token} must be in [-100, 100], got {bias}")
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"logit_bias names token {token}, outside the vocabulary")

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the output constraint, if any (kind is the field's name)."""
        for kind in GRAMMAR_FIELDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        )

    def expand_n(self) -> list[SamplingParams]:
        """The ``n`` single samples of this request; sample ``i`` uses ``seed + i`` (modulo
        2**64, so it stays a valid seed)."""
        if self.n == 1:
            return [self]
        return [
            self.replace(n=1, seed=None if self.seed is None else (self.seed + i) % (1 << 64))
            for i in range(self.n)
        ]

    def prefill_only(self) -> SamplingParams:
        """Parameters that run the prompt into the prefix cache and generate nothing."""
        no_grammar = dict.fromkeys(GRAMMAR_FIELDS)
        return self.replace(n=1, max_new_tokens=0, min_new_tokens=0, **no_grammar)

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def _logit_bias_pairs(raw: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` (keys are strings in JSON) as sorted pairs."""
    pairs = {}
    for key, bias in raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ValueError(f"logit_bias of token {key} must be a number")
        if not math.isfinite(bias):
            raise ValueError(f"logit_bias of token {key} must be a finite number")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))
