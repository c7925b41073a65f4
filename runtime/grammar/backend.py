"""Compiling grammars for the served model's tokenizer, off the scheduler's thread."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvflow.runtime.grammar.matcher import RequestGrammar
from kvflow.runtime.grammar.spec import GrammarSpec, build_grammar

__all__ = ["GrammarBackend"]
logger = logging.getLogger(__name__)


class GrammarBackend:
    """xgrammar's compiler for one tokenizer, a small thread pool and a bounded LRU cache.

    Each distinct :class:`GrammarSpec` compiles once: the cache keeps the compile's future
    (the first request starts it, later ones share it, also while it runs); the least
    recently used entry leaves when ``cache_size`` is exceeded. xgrammar releases the GIL
    while it compiles, so a slow compile does not stall the scheduler's loop.

    ``vocab_size`` is the width of the model's logits, which may exceed the tokenizer's
    vocabulary (padding): bitmasks cover all of it and padded ids are never allowed.
    ``stop_token_ids`` are the ids that end a grammar (the model's EOS ids). The tokenizer
    (transformers', from ``load_tokenizer``: its import takes seconds) and its xgrammar
    description (a pass over the vocabulary, about a second for 128k tokens) are made on the
    pool too, so creating the backend never stalls the caller.
    """

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        *,
        threads: int = 2,
        cache_size: int = 256,
    ) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._compiler = self._pool.submit(
            self._make_compiler, load_tokenizer, vocab_size, list(stop_token_ids)
        )
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache is touched by the scheduler thread only,
        self.cache_size = cache_size  # but a lock keeps the backend safe for any caller
        self.compiles = 0  # compiles started (cache misses)

    def request(self, spec: GrammarSpec) -> RequestGrammar:
        """A new request's grammar state; its compile starts now unless cached."""
        return RequestGrammar(spec, self._compiled(spec))

    def _compiled(self, spec: GrammarSpec) -> Future:
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self.compiles += 1
            self._cache[spec] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    @staticmethod
    def _make_compiler(
        load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: list[int]
    ) -> Any:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            load_tokenizer(), vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def _compile(self, spec: GrammarSpec) -> Any:
        grammar = build_grammar(spec)  # an invalid spec fails before waiting for the compiler
        return self._compiler.result().compile_grammar(grammar)

    @property
    def cached(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
