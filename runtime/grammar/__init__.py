"""Structured output: grammars (JSON schema, regex, EBNF, structural tag) compiled with
xgrammar, and the token bitmask that keeps each constrained request inside its grammar.

How a constrained request runs:

1. Entry (HTTP process): the request's :class:`SamplingParams` name a constraint
   (``json_schema``, ``regex``, ``ebnf`` or ``structural_tag``); :func:`check_grammar` on
   :func:`grammar_spec` of them raises :class:`GrammarError` (a 400) if it cannot build.
2. Scheduler process: ``ReqFactory`` gives the request a :class:`RequestGrammar` from the
   :class:`GrammarBackend`, whose compile runs on a thread pool (cached per spec). The
   scheduler keeps the request in its grammar queue until the compile ends, then queues it
   (or refuses it with the compile's error).
3. Each sampling step: :func:`apply_grammar_masks` masks the constrained rows' logits; each
   sampled token is accepted by the request's matcher; a terminated matcher finishes the
   request with ``stop``.
"""

from typing import TYPE_CHECKING

from kvflow.lazy import lazy_exports
from kvflow.runtime.grammar.backend import GrammarBackend
from kvflow.runtime.grammar.matcher import RequestGrammar
from kvflow.runtime.grammar.spec import (
    GRAMMAR_KINDS,
    JSON_OBJECT_SCHEMA,
    GrammarError,
    GrammarSpec,
    build_grammar,
    check_grammar,
    grammar_spec,
)

if TYPE_CHECKING:
    from kvflow.runtime.grammar.mask import apply_grammar_masks, bitmask_words
else:  # torch-free until a name is used (kvflow.lazy)
    __getattr__ = lazy_exports(__name__, {".mask": ("apply_grammar_masks", "bitmask_words")})

__all__ = [
    "GRAMMAR_KINDS",
    "JSON_OBJECT_SCHEMA",
    "GrammarBackend",
    "GrammarError",
    "GrammarSpec",
    "RequestGrammar",
    "apply_grammar_masks",
    "bitmask_words",
    "build_grammar",
    "check_grammar",
    "grammar_spec",
]
