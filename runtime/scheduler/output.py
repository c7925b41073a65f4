"""What the scheduler reports per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.runtime.scheduler.req import FinishReason

__all__ = ["TokenOutput"]


@dataclass(frozen=True)
class TokenOutput:
    """New tokens of one request in one step (possibly none, e.g. when it is aborted)."""

    rid: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    new_logprobs: list[float | None] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
