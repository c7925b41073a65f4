"""What the scheduler reports per request per step, and how a request ended."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FinishReason", "TokenOutput"]


@dataclass(frozen=True)
class FinishReason:
    """``stop`` (``matched`` = the stop token id or stop string that ended it),
    ``length`` (max_new_tokens or context reached) or ``abort`` (``message`` says why).

    For EOS, ``matched`` is the EOS token id, as for any stop token.
    """

    type: str
    matched: int | str | None = None
    message: str = ""
    # An abort before any token because a peer failed (prefill/decode): another worker may
    # serve the request, so an answer not yet started is a 503 (a router retries it).
    retryable: bool = False


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
    # prompt logprobs from the request's logprob_start_len on, once, when the prompt is done
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # an embedding request's normalised pooled hidden state, when it finishes
    embedding: list[float] | None = None
