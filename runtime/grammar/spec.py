"""What a request asks its output to follow, and turning that into an xgrammar ``Grammar``.

Building the grammar needs no tokenizer, so the HTTP process checks every spec this way at
request entry (an invalid one is a 400 with xgrammar's message) and the scheduler builds it
again to compile it (``Grammar`` objects do not cross processes).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvflow.runtime.wire import SamplingParams

__all__ = [
    "GRAMMAR_KINDS",
    "JSON_OBJECT_SCHEMA",
    "GrammarError",
    "GrammarSpec",
    "build_grammar",
    "check_grammar",
    "grammar_spec",
]

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
# OpenAI's response_format json_object: any JSON object (strict mode would allow only {}).
JSON_OBJECT_SCHEMA = '{"type": "object", "additionalProperties": true}'
# Longest whitespace run a JSON schema allows between tokens: any JSON layout up to deep
# indentation, but a model cannot spin on blank lines until max_tokens (small ones do).
JSON_MAX_WHITESPACE = 32
# xgrammar prefixes its C++ errors with a time stamp and a source position.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """A spec xgrammar cannot turn into a grammar; the message says what is wrong."""


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint: ``kind`` is one of :data:`GRAMMAR_KINDS` (SGLang's sampling
    parameter names), ``text`` its value as the request gave it (a JSON string for
    ``json_schema`` and ``structural_tag``). Equal specs share one compiled grammar."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; one of {GRAMMAR_KINDS}")


def grammar_spec(params: SamplingParams) -> GrammarSpec | None:
    """The constraint a request's sampling parameters name, if any."""
    found = params.grammar
    return None if found is None else GrammarSpec(*found)


def build_grammar(spec: GrammarSpec) -> Any:
    """The ``xgrammar.Grammar`` of ``spec``; raises :class:`GrammarError` if invalid."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(
                _json(spec.text, "json_schema"), max_whitespace_cnt=JSON_MAX_WHITESPACE
            )
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec.text)
        return _structural_tag(xgr, _json(spec.text, "structural_tag"), spec.text)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError, KeyError) as err:
        raise GrammarError(f"invalid {spec.kind}: {_clean(str(err))}") from None


def check_grammar(spec: GrammarSpec | None) -> None:
    """Raise :class:`GrammarError` unless ``spec`` (if given) builds."""
    if spec is not None:
        build_grammar(spec)


def _json(text: str, kind: str) -> str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise GrammarError(f"invalid {kind}: not JSON: {err}") from None
    if not isinstance(value, dict | bool):
        raise GrammarError(f"invalid {kind}: must be a JSON object")
    return text


def _structural_tag(xgr: Any, text: str, raw: str) -> Any:
    """SGLang's two forms: ``{"structures": [{begin, schema, end}], "triggers": [...]}``, or
    xgrammar's own structural tag format (``{"type": "structural_tag", "format": ...}``)."""
    value = json.loads(text)
    if "structures" not in value:
        return xgr.Grammar.from_structural_tag(raw)
    items = [
        xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
        for s in value["structures"]
    ]
    return xgr.Grammar.from_structural_tag(items, list(value.get("triggers", [])))


def _clean(message: str) -> str:
    return _XGRAMMAR_PREFIX.sub("", message.strip()).strip()
