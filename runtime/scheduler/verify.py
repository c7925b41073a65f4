"""The verify step of speculative decoding: drafts from a :class:`Drafter`, scored by one forward of the target.

Per request, the target runs its last token and its draft ``d_1..d_k`` at positions
``kv_len .. kv_len + k``, one decode row each (``build_verify_batch``: causal attention
over the drafted positions, a logits row for each, in the decode CUDA graphs). The rows give the target's choice after every prefix of the draft; the
acceptance rule keeps a prefix of the draft plus one target token. The caller appends the
tokens it keeps (a stop may cut them short), sets ``kv_len`` past them and calls
:meth:`SpecWorker.settle`, which frees the slots of the positions not kept::

    positions:  kv_len   kv_len+1 .. kv_len+a   kv_len+a+1 .. kv_len+k
    inputs:     last     d_1      .. d_a        d_a+1      .. d_k
    KV:         kept     kept        kept       freed (whole pages past the new kv_len)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvflow.runtime.config import EngineConfig
from kvflow.runtime.core import Req
from kvflow.runtime.model_runner import ModelRunner
from kvflow.runtime.sampling import SamplingBatch, needs_adjust
from kvflow.runtime.scheduler.batch import host_to_device
from kvflow.runtime.scheduler.kv import KVManager
from kvflow.runtime.speculative import DRAFTERS, Drafter, check_speculative
from kvflow.runtime.speculative.accept import (
    Verdict,
    accept_greedy,
    accept_sampled,
    target_probs,
)
from kvflow.runtime.speculative.batch import build_verify_batch

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
        """Drafts worth verifying: none where the logits change per token (penalties, bias,
        grammar, min_new_tokens), none past max_new_tokens or the context."""
        if needs_adjust(req):
            return 0
        remaining = req.sampling.max_new_tokens - len(req.output_ids) - 1
        room = self.runner.context_len - req.seq_len
        return max(0, min(self.max_drafts, remaining, room))

    def _fit(self, reqs: Sequence[Req], drafts: list[list[int]]) -> list[list[int]]:
        """Drop the drafts whose slots do not fit beside every request's next token (the
        caller made room for those)."""
        kv = self.kv
        spare = kv.available_tokens() - sum(kv.tokens_to_grow(r, 1) for r in reqs)
        for i, (req, draft) in enumerate(zip(reqs, drafts, strict=True)):
            extra = kv.tokens_to_grow(req, 1 + len(draft)) - kv.tokens_to_grow(req, 1)
            if extra > spare:
                drafts[i] = []
            else:
                spare -= extra
        return drafts

    @torch.inference_mode()
    def run(self, reqs: Sequence[Req]) -> list[StepTokens]:
        """Draft, take KV slots, verify in one forward and accept, for every request."""
        limits = [self._limit(r) for r in reqs]
        proposed = self.drafter.propose(reqs, limits)
        drafts = self._fit(reqs, [d[:n] for d, n in zip(proposed, limits, strict=True)])
        self._taken.clear()
        slots: list[int] = []
        for req, draft in zip(reqs, drafts, strict=True):
            taken = self.kv.grow_host(req, 1 + len(draft))
            if taken is None:
                raise RuntimeError(f"no KV slots for {req.rid} after making room")
            self._taken[id(req)] = (taken, req.kv_len)
            slots += taken
        device = self.runner.device
        fb = build_verify_batch(
            [r.req_pool_idx for r in reqs],
            [r.kv_len for r in reqs],
            [[r.all_token_ids()[r.kv_len], *d] for r, d in zip(reqs, drafts, strict=True)],
            host_to_device(slots, device),
            device,
        )
        logits = self.runner.forward(fb)
        starts, at = [], 0
        for draft in drafts:
            starts.append(at)
            at += 1 + len(draft)
        results: list[StepTokens | None] = [None] * len(reqs)
        plain = [i for i, d in enumerate(drafts) if not d]
        if plain:  # no draft: one token through the sampler, as a plain decode step
            plain_reqs = [reqs[i] for i in plain]
            batch = SamplingBatch.from_reqs(plain_reqs, self.runner.vocab_size, device)
            rows = logits[[starts[i] for i in plain]]
            out = self.runner.sampler.launch(rows, batch).resolve()
            for n, i in enumerate(plain):
                results[i] = StepTokens(
                    [out.next_token_ids[n]], [out.logprobs[n]], [out.top_logprobs[n]], 0
                )
        for i, draft in enumerate(drafts):
            if draft:
                rows = logits[starts[i] : starts[i] + 1 + len(draft)]
                results[i] = self._accept(reqs[i], draft, rows)
        return [r for r in results if r is not None]

    def _accept(self, req: Req, draft: list[int], rows: torch.Tensor) -> StepTokens:
        if req.sampling.is_greedy:
            verdict = accept_greedy(rows.argmax(dim=-1).tolist(), draft)
        else:
            probs = target_probs(rows, req.sampling, self.runner.vocab_size)
            made = len(req.output_ids)
            verdict = accept_sampled(probs, draft, lambda j: req.token_generator(made + j))
        self.drafted_tokens += len(draft)
        self.accepted_tokens += verdict.num_accepted
        logprobs, tops = _logprobs(req, rows, verdict)
        return StepTokens(verdict.tokens, logprobs, tops, len(draft))

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
        return self.drafter.is_memory_free()


def _logprobs(
    req: Req, rows: torch.Tensor, verdict: Verdict
) -> tuple[list[float | None], list[TopLogprobs]]:
    """The target's logprobs of the emitted tokens (the sampler's definition: before
    temperature and filtering), when the request asks for them."""
    count = len(verdict.tokens)
    if not req.return_logprob:
        return [None] * count, [None] * count
    logprobs = torch.log_softmax(rows[:count].float(), dim=-1)
    chosen: list[float | None] = []
    tops: list[TopLogprobs] = []
    for j, token in enumerate(verdict.tokens):
        chosen.append(float(logprobs[j, token]))
        if req.top_logprobs_num > 0:
            values, indices = logprobs[j].topk(req.top_logprobs_num)
            tops.append(list(zip(indices.tolist(), values.tolist(), strict=True)))
        else:
            tops.append(None)
    return chosen, tops


def make_spec_worker(config: EngineConfig, runner: ModelRunner, kv: KVManager) -> SpecWorker | None:
    """The scheduler's verify step for ``config`` (resolved), or None without speculation."""
    if config.speculative_algorithm is None:
        return None
    check_speculative(config)
    drafter = DRAFTERS.get(config.speculative_algorithm)(config, runner)
    return SpecWorker(runner, kv, drafter, config.speculative_num_draft_tokens)
