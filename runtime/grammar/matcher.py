"""One request's grammar: the compile it waits for, then its matcher state."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from kvflow.runtime.grammar.spec import GrammarError, GrammarSpec

__all__ = ["RequestGrammar"]


class RequestGrammar:
    """A request's constraint, from "compiling" to "terminated".

    Pending while its compile runs on the backend's thread pool (:attr:`ready` is False and
    the scheduler keeps the request out of batches); then a matcher that fills the request's
    row of the token bitmask and accepts each sampled token. Used by the scheduler's thread
    only; the compile's future is the one thing shared with the pool.
    """

    def __init__(self, spec: GrammarSpec, compiled: Future) -> None:
        self.spec = spec
        self._compiled = compiled
        self._matcher: Any = None
        self.error: str | None = None  # why the compile failed (the request is refused)
        self.accepted = 0

    @property
    def future(self) -> Future:
        return self._compiled

    @property
    def ready(self) -> bool:
        """Whether the compile has ended (then :attr:`error` or the matcher is set)."""
        if self._matcher is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        try:
            compiled = self._compiled.result()
        except GrammarError as err:
            self.error = str(err)
            return True
        except Exception as err:  # an xgrammar failure we did not foresee: refuse the request
            self.error = f"cannot compile the {self.spec.kind}: {type(err).__name__}: {err}"
            return True
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        return True

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            raise RuntimeError("the grammar is not compiled yet")
        return self._matcher

    def fill_mask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (host, int32)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it."""
        ok = bool(self.matcher.accept_token(token_id))
        self.accepted += ok
        return ok

    @property
    def terminated(self) -> bool:
        """The grammar reached its end (a stop token was accepted where it may end)."""
        return self._matcher is not None and bool(self._matcher.is_terminated())
