"""Prompt (input) logprobs of one request: SGLang's ``logprob_start_len``.

The logprob of prompt token ``p`` comes from the logits at position ``p - 1``, so the
prefill must run positions ``start - 1 .. len(prompt) - 2`` itself: the request may reuse
cached KV only before ``start - 1`` (:meth:`InputLogprobs.reuse_limit`), and each prefill
chunk asks the model for the logits of its positions from ``start - 1`` on, not only of its
last one (:meth:`InputLogprobs.extra_rows`). Token ``start`` has no logprob when ``start``
is 0 (``None``, as SGLang reports it). Chunks of one prompt come in order, so the values
are appended as they come.
"""

from __future__ import annotations

import torch

__all__ = ["InputLogprobs"]


class InputLogprobs:
    """The prompt logprobs a request collects from ``start`` on, sent once complete."""

    def __init__(self, start: int, prompt_ids: list[int], top_n: int) -> None:
        self.start = start
        self.prompt_ids = prompt_ids
        self.top_n = top_n
        self.values: list[float | None] = [None] if start == 0 else []
        self.tops: list[list[tuple[int, float]] | None] = [None] if start == 0 else []
        self.sent = False

    @property
    def complete(self) -> bool:
        return len(self.values) == len(self.prompt_ids) - self.start

    def reuse_limit(self, seq_len: int) -> int:
        """How many leading tokens may come from the prefix cache (all but the last one
        once the logprobs are complete: a retracted request runs again as any other)."""
        if self.complete:
            return seq_len - 1
        return min(seq_len - 1, max(self.start - 1, 0))

    def extra_rows(self, kv_len: int, take: int) -> int:
        """Logit rows a prefill chunk of positions ``kv_len .. kv_len + take - 1`` needs
        before its last one (whose logits the step computes anyway)."""
        if self.complete:
            return 0
        first = max(self.start - 1, kv_len, 0)
        return max(kv_len + take - 1 - first, 0)

    def record(self, logits: torch.Tensor, first_position: int) -> None:
        """Logits of positions ``first_position ..`` (one row each, in order): keep the
        logprob of each next prompt token (the row of the last prompt position predicts an
        output token and is skipped)."""
        # the next position to score: rows before it were recorded already (a request
        # retracted mid-prompt runs its positions again) or are before start - 1
        begin = max(self.start - 1, 0) + len(self.values) - (1 if self.start == 0 else 0)
        if first_position < begin:
            logits, first_position = logits[begin - first_position :], begin
        last = len(self.prompt_ids) - 2  # the last position that predicts a prompt token
        count = min(logits.shape[0], last - first_position + 1)
        if count <= 0:
            return
        logprobs = torch.log_softmax(logits[:count].float(), dim=-1)
        targets = self.prompt_ids[first_position + 1 : first_position + 1 + count]
        index = torch.tensor(targets, device=logprobs.device)[:, None]
        self.values += logprobs.gather(1, index)[:, 0].tolist()
        if self.top_n > 0:
            values, indices = logprobs.topk(self.top_n, dim=-1)
            self.tops += [
                list(zip(i, v, strict=True))
                for i, v in zip(indices.tolist(), values.tolist(), strict=True)
            ]
        else:
            self.tops += [None] * count

    def fill(self, values: list[float | None], tops: list[list[list[float]] | None] | None) -> None:
        """Take the values another process computed (a PD decode: its prefill's), as
        :meth:`take` gives them out; ``tops`` pairs as ``[token_id, logprob]``."""
        if len(values) != len(self.prompt_ids) - self.start:
            raise ValueError(
                f"{len(values)} prompt logprobs for {len(self.prompt_ids) - self.start} positions"
            )
        self.values = list(values)
        self.tops = [
            [(int(t), float(lp)) for t, lp in top] if top else None
            for top in (tops or [None] * len(values))
        ]

    def take(self) -> tuple[list[float | None], list[list[tuple[int, float]] | None]] | None:
        """The values, once complete and not sent yet (then marked sent)."""
        if self.sent or not self.complete:
            return None
        self.sent = True
        return self.values, self.tops
