"""The verify step of speculative decoding: drafts from a :class:`Drafter`, scored by one forward of the target.

Per request, the target runs its last token and its draft ``d_1..d_k`` at positions
``kv_len .. kv_len + k``, one decode row each (``build_decode_batch``: causal attention
over the drafted positions, a logits row for each, in the decode CUDA graphs). The rows give the target's choice after every prefix of the draft; the
acceptance rule keeps a prefix of the draft plus one target token. The caller appends the
tokens it keeps (a stop may cut them short), sets ``kv_len`` past them and calls
:meth:`SpecWorker.settle`, which frees the slots of the positions not kept::

    positions:  kv_len   kv_len+1 .. kv_len+a   kv_len+a+1 .. kv_len+k
    inputs:     last     d_1      .. d_a        d_a+1      .. d_k
    KV:         kept     kept        kept       freed (whole pages past the new kv_len)

A draft tree (``--speculative-eagle-topk`` > 1, page size 1) is verified the same way, one
decode row per node at position ``kv_len + depth``, each node off the tree's leading chain
through a spare row holding its ancestors (:func:`~kvflow.runtime.speculative.tree_rows.
verify_rows`). Once a path is accepted the request's row is rewritten so that the path's
slots follow the root's, and :meth:`SpecWorker.settle` frees the rest as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvflow.runtime.config import EngineConfig
from kvflow.runtime.core import Req
from kvflow.runtime.host_copy import host_to_device
from kvflow.runtime.model_runner import ModelRunner
from kvflow.runtime.sampling import SamplingBatch, needs_adjust
from kvflow.runtime.scheduler.kv import KVManager
from kvflow.runtime.speculative import DRAFTERS, Drafter, TreeDrafter, check_speculative
from kvflow.runtime.speculative.accept import (
    accept_greedy,
    accept_sampled,
    accept_tree_greedy,
    accept_tree_sampled,
    target_probs,
)
from kvflow.runtime.speculative.batch import build_decode_batch
from kvflow.runtime.speculative.tree import DraftTree
from kvflow.runtime.speculative.tree_rows import spare_rows, verify_rows

__all__ = ["SpecWorker", "StepTokens", "make_spec_worker"]

TopLogprobs = list[tuple[int, float]] | None


class StepTokens(NamedTuple):
    """One request's tokens from a verify step, in order, with their logprobs."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs]
    num_drafts: int


class SpecWorker:
    """Runs verify steps for a scheduler; keeps the acceptance counters."""

    def __init__(
        self, runner: ModelRunner, kv: KVManager, drafter: Drafter, num_draft_tokens: int
    ) -> None:
        self.runner = runner
        self.kv = kv
        self.drafter = drafter
        self.max_drafts = num_draft_tokens - 1
        self._taken: dict[int, tuple[list[int], int]] = {}  # id(req) -> (slots, first position)
        self.verified_reqs = 0  # request-steps verified since start
        self.emitted_tokens = 0  # tokens they kept (accepted drafts + the target's own)
        self.drafted_tokens = 0
        self.accepted_tokens = 0

    @property
    def accept_length(self) -> float:
        """SGLang's ``spec_accept_length``: tokens kept per request per verify step."""
        return self.emitted_tokens / self.verified_reqs if self.verified_reqs else 0.0

    def _limit(self, req: Req) -> int:
        """Drafts worth verifying (a tree: its depth): none where the logits change per
        token (penalties, bias, grammar, min_new_tokens), none past max_new_tokens or the
        context."""
        if needs_adjust(req):
            return 0
        remaining = req.sampling.max_new_tokens - len(req.output_ids) - 1
        room = self.runner.context_len - req.seq_len
        return max(0, min(self.max_drafts, remaining, room))

    def _fit(self, reqs: Sequence[Req], trees: list[DraftTree]) -> list[DraftTree]:
        """Drop the drafts whose slots do not fit beside every request's next token (the
        caller made room for those)."""
        kv = self.kv
        spare = kv.available_tokens() - sum(kv.tokens_to_grow(r, 1) for r in reqs)
        for i, (req, tree) in enumerate(zip(reqs, trees, strict=True)):
            extra = kv.tokens_to_grow(req, 1 + len(tree)) - kv.tokens_to_grow(req, 1)
            if extra > spare:
                trees[i] = DraftTree()
            else:
                spare -= extra
        return trees

    def _propose(self, reqs: Sequence[Req], limits: list[int]) -> list[DraftTree]:
        if isinstance(self.drafter, TreeDrafter):
            return self.drafter.propose_trees(reqs, limits)
        proposed = self.drafter.propose(reqs, limits)
        return [DraftTree.chain(d[:n]) for d, n in zip(proposed, limits, strict=True)]

    @torch.inference_mode()
    def run(self, reqs: Sequence[Req]) -> list[StepTokens]:
        """Draft, take KV slots, verify in one forward and accept, for every request."""
        limits = [self._limit(r) for r in reqs]
        trees = self._fit(reqs, self._propose(reqs, limits))
        self._taken.clear()
        slots: list[int] = []
        for req, tree in zip(reqs, trees, strict=True):
            taken = self.kv.grow_host(req, 1 + len(tree))
            if taken is None:
                raise RuntimeError(f"no KV slots for {req.rid} after making room")
            self._taken[id(req)] = (taken, req.kv_len)
            slots += taken
        device = self.runner.device
        with spare_rows(self.runner.req_to_token) as spare:
            rows = verify_rows(reqs, trees, [self._taken[id(r)][0] for r in reqs], spare)
            fb = build_decode_batch(*rows, host_to_device(slots, device), device)
            logits = self.runner.forward(fb)
        starts, at = [], 0
        for tree in trees:
            starts.append(at)
            at += 1 + len(tree)
        results: list[StepTokens | None] = [None] * len(reqs)
        plain = [i for i, tree in enumerate(trees) if not tree]
        if plain:  # no draft: one token through the sampler, as a plain decode step
            plain_reqs = [reqs[i] for i in plain]
            batch = SamplingBatch.from_reqs(plain_reqs, self.runner.vocab_size, device)
            plain_rows = logits[[starts[i] for i in plain]]
            out = self.runner.sampler.launch(plain_rows, batch).resolve()
            for n, i in enumerate(plain):
                results[i] = StepTokens(
                    [out.next_token_ids[n]], [out.logprobs[n]], [out.top_logprobs[n]], 0
                )
        for i, tree in enumerate(trees):
            if tree:
                results[i] = self._accept(
                    reqs[i], tree, logits[starts[i] : starts[i] + 1 + len(tree)]
                )
        return [r for r in results if r is not None]

    def _accept(self, req: Req, tree: DraftTree, rows: torch.Tensor) -> StepTokens:
        """``rows``: the target's logits after the root, then after each node."""
        chain = tree.chain_len() == len(tree)
        if req.sampling.is_greedy:
            target_ids = rows.argmax(dim=-1).tolist()
            if chain:
                tokens, accepted = accept_greedy(target_ids, tree.tokens)
                path = list(range(accepted))
            else:
                tokens, path = accept_tree_greedy(target_ids, tree)
        else:
            probs = target_probs(rows, req.sampling, self.runner.vocab_size)
            made = len(req.output_ids)

            def generator_at(j: int) -> torch.Generator | None:
                return req.token_generator(made + j)

            if chain:
                tokens, accepted = accept_sampled(probs, tree.tokens, generator_at)
                path = list(range(accepted))
            else:
                tokens, path = accept_tree_sampled(probs, tree, generator_at)
        if path != list(range(len(path))):
            self._keep_path(req, tree, path)
        self.drafted_tokens += len(tree)
        self.accepted_tokens += len(path)
        logprobs, tops = _logprobs(req, rows[[0, *(1 + j for j in path)]], tokens)
        return StepTokens(tokens, logprobs, tops, len(tree))

    def _keep_path(self, req: Req, tree: DraftTree, path: list[int]) -> None:
        """Point the request's row at the accepted nodes' slots, right after the root's,
        and the rest after them: :meth:`settle` frees whatever lies past the kept tokens
        (slot numbers move, no KV is copied)."""
        taken, start = self._taken[id(req)]
        on_path = set(path)
        rest = [j for j in range(len(tree)) if j not in on_path]
        order = [taken[0], *(taken[1 + j] for j in path), *(taken[1 + j] for j in rest)]
        self.kv.req_to_token.write(
            req.req_pool_idx, start, host_to_device(order, self.runner.device)
        )
        self._taken[id(req)] = (order, start)

    def settle(self, req: Req, kept: int) -> None:
        """The request kept ``kept`` tokens of its step (``kv_len`` already past them):
        free the slots of the positions not kept, tell the drafter."""
        slots, start = self._taken.pop(id(req))
        self.kv.shrink(req, slots, start)
        self.verified_reqs += 1
        self.emitted_tokens += kept
        self.drafter.accepted(req, kept - 1)

    def forget(self, req: Req) -> None:
        self._taken.pop(id(req), None)
        self.drafter.forget(req)

    def is_memory_free(self) -> bool:
        rows = self.runner.req_to_token
        return rows.spare_available() == rows.spare_rows and self.drafter.is_memory_free()


def _logprobs(
    req: Req, rows: torch.Tensor, tokens: list[int]
) -> tuple[list[float | None], list[TopLogprobs]]:
    """The target's logprobs of the emitted tokens (the sampler's definition: before
    temperature and filtering; ``rows[j]``: the logits ``tokens[j]`` was chosen from),
    when the request asks for them."""
    count = len(tokens)
    if not req.return_logprob:
        return [None] * count, [None] * count
    logprobs = torch.log_softmax(rows[:count].float(), dim=-1)
    chosen: list[float | None] = []
    tops: list[TopLogprobs] = []
    for j, token in enumerate(tokens):
        chosen.append(float(logprobs[j, token]))
        if req.top_logprobs_num > 0:
            values, indices = logprobs[j].topk(req.top_logprobs_num)
            tops.append(list(zip(indices.tolist(), values.tolist(), strict=True)))
        else:
            tops.append(None)
    return chosen, tops


def make_spec_worker(config: EngineConfig, runner: ModelRunner, kv: KVManager) -> SpecWorker | None:
    """The scheduler's verify step for ``config`` (resolved), or None without speculation
    (or where the engine only keeps features for a PD decode's head)."""
    if config.speculative_algorithm is None or config.speculative_features_only:
        return None
    check_speculative(config)
    drafter = DRAFTERS.get(config.speculative_algorithm)(config, runner)
    return SpecWorker(runner, kv, drafter, config.speculative_num_draft_tokens)
