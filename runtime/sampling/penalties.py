"""Logit penalties, applied per request row before sampling."""

from __future__ import annotations

import torch

from kvflow.runtime.wire import SamplingParams

__all__ = ["apply_logit_bias", "apply_penalties"]


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> None:
    """Penalize ``logits`` ``[vocab]`` in place for one request.

    Repetition (Hugging Face): every token seen in the prompt or output has its logit
    divided by the penalty if positive, multiplied if negative. Frequency and presence
    (OpenAI): subtract ``frequency * count + presence * (count > 0)`` over output tokens.
    """
    device = logits.device
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(prompt_ids) | set(output_ids)), dtype=torch.int64, device=device
        )
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        out = torch.tensor(output_ids, dtype=torch.int64, device=device)
        counts = torch.bincount(out, minlength=logits.numel()).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
            logits.dtype
        )


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> None:
    """Add OpenAI's ``logit_bias`` (``(token_id, bias)`` pairs) to ``logits`` ``[vocab]``."""
    ids = torch.tensor([t for t, _ in bias], dtype=torch.int64, device=logits.device)
    values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
    logits.index_add_(0, ids, values)
