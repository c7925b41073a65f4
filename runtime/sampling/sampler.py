"""The batched sampler: penalties, masks, logprobs, then greedy or seeded sampling per row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvflow.runtime.grammar import apply_grammar_masks
from kvflow.runtime.sampling.penalties import apply_logit_bias, apply_penalties

if TYPE_CHECKING:
    from kvflow.runtime.core import Req
    from kvflow.runtime.distributed import TPGroup

__all__ = [
    "PendingSample",
    "SampleOutput",
    "Sampler",
    "SamplingBatch",
    "filtered_out",
    "needs_adjust",
]


@dataclass(frozen=True)
class SamplingBatch:
    """The per-row parameters of one batch, gathered from its requests."""

    reqs: Sequence[Req]
    # Per-row tensors, None when every row is greedy (no host-to-device copies then).
    temperatures: torch.Tensor | None  # [B, 1]; 1.0 on greedy rows (never divides by zero)
    top_ps: torch.Tensor | None  # [B]
    top_ks: torch.Tensor | None  # [B]; vocab size where disabled
    min_ps: torch.Tensor | None  # [B]
    greedy: list[bool]
    needs_filter: bool  # some row uses top-k, top-p or min-p

    @classmethod
    def from_reqs(cls, reqs: Sequence[Req], vocab_size: int, device: str) -> SamplingBatch:
        params = [r.sampling for r in reqs]
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return cls(reqs, None, None, None, None, greedy, needs_filter=False)
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_ks = [vocab_size if p.top_k < 1 else min(p.top_k, vocab_size) for p in params]
        return cls(
            reqs=reqs,
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device)[:, None],
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            greedy=greedy,
            needs_filter=any(
                not g and (p.top_p < 1 or p.top_k > 0 or p.min_p > 0)
                for p, g in zip(params, greedy, strict=True)
            ),
        )


@dataclass(frozen=True)
class SampleOutput:
    next_token_ids: list[int]
    logprobs: list[float | None]  # log-probability of the chosen token (when asked)
    top_logprobs: list[list[tuple[int, float]] | None]


class PendingSample:
    """Sampled ids still on their way to the host (see :meth:`Sampler.launch`)."""

    def __init__(
        self,
        next_token_ids: torch.Tensor,
        host_ids: torch.Tensor,
        ready: torch.cuda.Event | None,
        logprobs: torch.Tensor | None,
        reqs: Sequence[Req],
    ) -> None:
        self.next_token_ids = next_token_ids  # [B] on the logits' device
        self._host_ids, self._ready = host_ids, ready
        self._logprobs, self._reqs = logprobs, reqs

    def resolve(self) -> SampleOutput:
        """Wait for the ids (only them, not the work queued after) and build the output."""
        if self._ready is not None:
            self._ready.synchronize()
        ids = self._host_ids.tolist()
        return SampleOutput(ids, *self._logprob_info(self._logprobs, ids, self._reqs))

    @staticmethod
    def _logprob_info(logprobs: torch.Tensor | None, ids: list[int], reqs: Sequence[Req]):
        chosen: list[float | None] = [None] * len(reqs)
        tops: list[list[tuple[int, float]] | None] = [None] * len(reqs)
        if logprobs is None:
            return chosen, tops
        for row, req in enumerate(reqs):
            if not req.return_logprob:
                continue
            chosen[row] = float(logprobs[row, ids[row]])
            if req.top_logprobs_num > 0:
                values, indices = logprobs[row].topk(req.top_logprobs_num)
                tops[row] = list(zip(indices.tolist(), values.tolist(), strict=True))
        return chosen, tops


def filtered_out(
    sorted_probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """Which entries of each row of ``sorted_probs`` ([B, V], descending) top-k, top-p and
    min-p drop (``[B]`` parameters each); the first entry is always kept."""
    rank = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)[None, :]
    drop = rank >= top_ks[:, None]
    # top-p keeps the smallest head whose mass reaches top_p (always the first token)
    drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_ps[:, None]
    drop |= sorted_probs < min_ps[:, None] * sorted_probs[:, :1]
    return drop


def needs_adjust(req: Req) -> bool:
    """Whether the request's logits change per token before sampling (penalties, logit
    bias, a grammar, min_new_tokens still banning its stop tokens)."""
    params = req.sampling
    return (
        params.has_penalties
        or bool(params.logit_bias)
        or req.grammar is not None
        or (len(req.output_ids) < params.min_new_tokens and bool(req.stop_token_set))
    )


class Sampler:
    """Turns a batch's last-position logits ``[B, vocab]`` into one token per request.

    Logprobs are those of the model's distribution after penalties, logit bias and masks
    (min_new_tokens, grammar), before temperature and top-k/top-p/min-p filtering.
    """

    def __init__(self, vocab_size: int, device: str, tp: TPGroup | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # Tensor parallelism: every rank samples from the same logits with the same seeds;
        # rank 0's ids are broadcast anyway, so no rounding or library difference can make
        # the ranks' schedules part.
        self.tp = tp

    def _adjust(self, logits: torch.Tensor, reqs: Sequence[Req]) -> None:
        for row, req in enumerate(reqs):
            params = req.sampling
            if params.has_penalties:
                apply_penalties(logits[row], params, req.origin_input_ids, req.output_ids)
            if len(req.output_ids) < params.min_new_tokens and req.stop_token_set:
                banned = torch.tensor(
                    sorted(req.stop_token_set), dtype=torch.int64, device=logits.device
                )
                logits[row, banned] = float("-inf")
            if params.logit_bias:
                apply_logit_bias(logits[row], params.logit_bias)
        # last: no bias brings back a token the grammar forbids
        apply_grammar_masks(logits, [r.grammar for r in reqs])

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        return self.launch(logits, batch).resolve()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, batch: SamplingBatch) -> PendingSample:
        """Queue the sampling of ``logits`` on the device and return without waiting.

        The chosen ids stay on the device (``next_token_ids``, usable as the next decode
        step's input) and travel to pinned host memory behind an event, so the caller can
        do host work while the GPU finishes, then call :meth:`PendingSample.resolve`.
        """
        want_logprobs = any(r.return_logprob for r in batch.reqs)
        adjust = any(self._needs_adjust(r) for r in batch.reqs)
        if all(batch.greedy) and not want_logprobs and not adjust:
            # argmax of the compute-dtype logits equals argmax of their exact fp32 upcast
            next_ids = logits.argmax(dim=-1)
            logprobs = None
        else:
            logits = logits.float()
            self._adjust(logits, batch.reqs)
            logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
            next_ids = logits.argmax(dim=-1)
            if not all(batch.greedy):
                assert batch.temperatures is not None
                probs = torch.softmax(logits / batch.temperatures, dim=-1)
                sampled = self._sample_rows(probs, batch)
                greedy = torch.tensor(batch.greedy, device=logits.device)
                next_ids = torch.where(greedy, next_ids, sampled)
        if self.tp is not None:
            self.tp.broadcast(next_ids)
        if next_ids.device.type != "cuda":
            return PendingSample(next_ids, next_ids, None, logprobs, batch.reqs)
        host = torch.empty(next_ids.shape, dtype=next_ids.dtype, pin_memory=True)
        host.copy_(next_ids, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return PendingSample(next_ids, host, ready, logprobs, batch.reqs)

    @staticmethod
    def _needs_adjust(req: Req) -> bool:
        return needs_adjust(req)

    def _sample_rows(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.needs_filter:
            assert (
                batch.top_ks is not None and batch.top_ps is not None and batch.min_ps is not None
            )
            sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
            drop = filtered_out(sorted_probs, batch.top_ks, batch.top_ps, batch.min_ps)
            probs, index = sorted_probs.masked_fill(drop, 0.0), sorted_ids
        else:
            index = None
        picks = torch.zeros(probs.shape[0], dtype=torch.int64, device=probs.device)
        for row, req in enumerate(batch.reqs):
            if not batch.greedy[row]:
                generator = req.next_token_generator()
                picks[row] = torch.multinomial(probs[row], 1, generator=generator)[0]
        if index is not None:
            picks = index.gather(1, picks[:, None])[:, 0]
        return picks
