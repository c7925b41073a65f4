"""The drafter contract: what a speculative algorithm proposes for the target to verify."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.runtime.core import Req
    from kvflow.runtime.speculative.tree import DraftTree

__all__ = ["Drafter", "TreeDrafter"]


class Drafter(ABC):
    """Proposes draft tokens for running requests; one instance per scheduler.

    A step calls :meth:`propose` for every request of the verify batch, then, once the
    target has accepted a prefix, :meth:`accepted` for each of them. A request that leaves
    (finished, aborted, retracted, failed) is passed to :meth:`forget`. Drafts are point
    guesses (no draft distribution): the sampled acceptance rule treats them as such, which
    keeps the target's distribution exactly.
    """

    @abstractmethod
    def propose(self, reqs: Sequence[Req], max_drafts: Sequence[int]) -> list[list[int]]:
        """Up to ``max_drafts[i]`` tokens to follow request i's tokens (may be fewer, or
        none); ``all_token_ids()`` of each request is unchanged until :meth:`accepted`."""

    def accepted(self, req: Req, num_accepted: int) -> None:
        """Request ``req`` kept the first ``num_accepted`` tokens of its last draft (its
        tokens now include them and one target token after them); stateless: nothing."""
        return None

    def forget(self, req: Req) -> None:
        """The request left the running batch: drop whatever is kept for it."""
        return None

    def is_memory_free(self) -> bool:
        """True when no request holds the drafter's memory (the leak check)."""
        return True

    def held_tokens(self) -> int:
        """KV slots of the drafter's own pool that requests hold (0: none, or no pool)."""
        return 0


class TreeDrafter(Drafter):
    """A drafter of trees (``--speculative-eagle-topk`` > 1): the verify step calls
    :meth:`propose_trees` instead of :meth:`propose`; :meth:`accepted` and :meth:`forget`
    keep their meaning (``num_accepted``: nodes on the accepted path)."""

    @abstractmethod
    def propose_trees(self, reqs: Sequence[Req], max_depths: Sequence[int]) -> list[DraftTree]:
        """A tree per request, at most ``max_depths[i]`` deep (empty for 0) and of at most
        ``--speculative-num-draft-tokens - 1`` nodes."""
