"""Messages between the runtime's processes: typed dataclasses, one serializer.

Flow::

    TokenizerManager --GenerateRequest/AbortRequest/ControlRequest--> Scheduler
    Scheduler --StreamStart/TokenBatch--> Detokenizer --TextBatch--> TokenizerManager
    Scheduler --ControlReply/SchedulerStats--> TokenizerManager
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from kvflow.runtime.wire.disagg import Bootstrap
from kvflow.runtime.wire.hicache import HiCacheStats
from kvflow.runtime.wire.outputs import FinishReason, TokenOutput
from kvflow.runtime.wire.sampling import SamplingParams

__all__ = [
    "AbortRequest",
    "ControlReply",
    "ControlRequest",
    "GenerateRequest",
    "SchedulerStats",
    "StreamStart",
    "TextBatch",
    "TextOutput",
    "TokenBatch",
    "dumps",
    "loads",
]


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One prompt to generate for, declared once: the HTTP layer builds it from a request
    body (or the engine from its arguments), the tokenizer manager names it and sends it,
    the scheduler builds its :class:`~kvflow.runtime.scheduler.Req` from it. Derived copies
    (one per sample of ``n``, a prefill's one-token cap) are made with
    ``dataclasses.replace``; a new per-request field is one line here plus its uses.
    """

    input_ids: list[int]
    sampling: SamplingParams  # validated at the edge
    rid: str | None = None  # SGLang's ``rid``: the client's (one sample only), else named on submit
    stream: bool = False  # the client reads tokens as they come (labels the TTFT metric)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # SGLang's: >= 0 with return_logprob asks for prompt logprobs
    extra_key: str | None = None  # cache namespace: prefixes are shared only within one
    lora_path: str | None = None  # SGLang's: the LoRA adapter's name (None: the base model)
    bootstrap: Bootstrap | None = None  # prefill/decode roles: the pairing with the peer
    probe: bool = False  # /health_generate's own: runs on any role past its queues, no room
    # SGLang's EmbeddingReqInput: the prompt's pooled hidden state instead of tokens (an
    # embedding server's requests; sampling is then prefill_only)
    embed: bool = False

    @property
    def request_id(self) -> str:
        """The id the scheduler knows the request by (set before it is sent)."""
        if self.rid is None:
            raise ValueError("the request was not named before it was sent")
        return self.rid


@dataclass(frozen=True)
class AbortRequest:
    rid: str
    message: str = "aborted by the client"


@dataclass(frozen=True)
class ControlRequest:
    """A request/reply exchange with the scheduler: ``flush_cache``, ``get_stats``,
    ``load_lora_adapter`` or ``unload_lora_adapter`` (``payload``: SGLang's body,
    ``lora_name`` and ``lora_path``)."""

    request_id: str
    kind: str
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ControlReply:
    request_id: str
    ok: bool
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerStats:
    """Published by the scheduler after each step and when idle (for /metrics and /get_server_info)."""

    num_running_reqs: int
    num_queue_reqs: int
    kv_total_tokens: int
    kv_used_tokens: int  # held by requests or by the prefix cache
    kv_request_tokens: int  # held by requests only (0 when idle: the leak check)
    cached_tokens: int  # held by the prefix cache
    evictable_tokens: int  # prefix cache entries no request locks
    generated_tokens: int  # sampled since start (for the throughput gauge)
    free_request_rows: int
    total_request_rows: int
    forward_steps: int
    num_retractions: int
    # prefill/decode roles (0 in unified): queues under SGLang's names, the prefill's KV writes
    num_prefill_inflight_queue_reqs: int = 0
    num_decode_prealloc_queue_reqs: int = 0
    num_decode_transfer_queue_reqs: int = 0
    kv_transfers: int = 0  # writes completed since start
    kv_transfer_failures: int = 0
    kv_transfer_retries: int = 0  # transport calls repeated (the transport's count)
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    recent_kv_transfers: tuple[tuple[float, int], ...] = ()  # (seconds, bytes) of the last ones
    hicache: HiCacheStats | None = None  # with a host tier (--hicache-host-memory-gb)
    num_grammar_queue_reqs: int = 0  # waiting for their grammar's compile (SGLang's name)
    dp_rank: int = 0  # the data-parallel group that reported (a merged record: 0)
    # speculative decoding: request-steps verified, and the tokens they kept, since start
    spec_verified_reqs: int = 0
    spec_emitted_tokens: int = 0
    spec_draft_kv_tokens: int = 0  # a draft model's KV slots held (0 when idle: the leak check)

    @property
    def spec_accept_length(self) -> float:
        """SGLang's ``spec_accept_length``: tokens kept per request per verify step (the
        accepted drafts plus the target's own token), since start; 0 without speculation."""
        return (
            self.spec_emitted_tokens / self.spec_verified_reqs if self.spec_verified_reqs else 0.0
        )

    @property
    def token_usage(self) -> float:
        """SGLang's ``token_usage``: slots that cannot be reclaimed without stopping a
        request (what requests hold, plus cached prefixes they lock) over all slots."""
        return (self.kv_used_tokens - self.evictable_tokens) / max(self.kv_total_tokens, 1)


@dataclass(frozen=True)
class StreamStart:
    """Scheduler -> detokenizer, before a request's first tokens (same socket, so ordered)."""

    rid: str
    prompt_ids: list[int]
    stop: tuple[str, ...]
    skip_special_tokens: bool


@dataclass(frozen=True)
class TokenBatch:
    outputs: list[TokenOutput]


@dataclass(frozen=True)
class TextOutput:
    """New text of one request (the detokenizer's output)."""

    rid: str
    text_delta: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    new_logprobs: list[float | None]
    new_top_logprobs: list[list[tuple[int, float]] | None]
    input_logprobs: list[float | None] | None = None  # see TokenOutput
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    embedding: list[float] | None = None  # see TokenOutput


@dataclass(frozen=True)
class TextBatch:
    outputs: list[TextOutput]


def dumps(message: object) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)
