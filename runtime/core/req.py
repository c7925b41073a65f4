"""A request as the scheduler sees it: token ids, KV state, sampling and finish state."""

from __future__ import annotations

import time
from typing import Any

import torch

from kvflow.runtime.detokenizer import IncrementalDetokenizer, find_stop
from kvflow.runtime.wire import Bootstrap, FinishReason, GenerateRequest

__all__ = ["Req", "position_seed"]

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, index: int) -> int:
    """A 63-bit seed for output token ``index`` of a request seeded ``seed`` (SplitMix64's
    finaliser over both, so neighbouring seeds and positions give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Req:
    """One sequence being generated. ``n > 1`` requests arrive here as ``n`` Reqs.

    Built from the request message (``message``, unchanged; its fields are read through
    the attributes below), plus what the scheduler adds: the model's stop tokens, the
    tokenizer for stop strings, the device of its sampling generator and its default seed.

    KV state: positions ``0:kv_len`` of ``all_token_ids()`` have KV in the slots recorded
    in row ``req_pool_idx``; the first ``len(prefix_indices)`` of those belong to the
    prefix cache (locked through ``last_node``), the rest to this request.
    """

    def __init__(
        self,
        message: GenerateRequest,
        *,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer: Any = None,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        self.message = message
        self.rid = message.request_id
        self.origin_input_ids = list(message.input_ids)
        self.output_ids: list[int] = []
        sampling = self.sampling = message.sampling
        self.lora_path = message.lora_path
        # the prefix cache's namespace; ReqFactory adds the adapter's key to it
        self.extra_key = message.extra_key
        self.bootstrap: Bootstrap | None = message.bootstrap  # PD roles: the peer's room
        self.return_logprob = message.return_logprob
        self.top_logprobs_num = message.top_logprobs_num
        self.stop_token_set = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            self.stop_token_set |= set(eos_token_ids)
        # The output constraint (kvflow.runtime.grammar.RequestGrammar), set by ReqFactory.
        self.grammar: Any = None
        # Prompt logprobs (kvflow.runtime.scheduler.input_logprobs), set by ReqFactory.
        self.input_logprobs: Any = None
        # An embedding request's pooling (kvflow.runtime.pooling.Pool), set by ReqFactory.
        self.pool: Any = None
        # Sampled requests draw output token i from a generator seeded by (seed, i): the
        # draws do not depend on which process samples which token (a PD pair's prefill
        # draws the first, its decode the rest), nor on retraction and recomputation.
        self.seed = sampling.seed if sampling.seed is not None else seed
        self._generator: torch.Generator | None = None
        if not sampling.is_greedy:
            self._generator = torch.Generator(device=device)
        # Stop strings are matched on text, so the scheduler decodes such requests itself.
        self._stop_text = (
            IncrementalDetokenizer(tokenizer, message.input_ids, sampling.skip_special_tokens)
            if sampling.stop and tokenizer is not None
            else None
        )

        self.req_pool_idx: int = -1
        self.kv_len = 0
        # Positions with a slot recorded in the row: kv_len, or more while a step that
        # grew the request has not advanced kv_len yet (freed with the request if it fails).
        self.kv_reserved_len = 0
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node: Any = None
        self.last_loc: int | None = None  # slot of position kv_len - 1, when known on the host
        self.extend_len = 0  # new tokens in the current prefill step
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        self.storage_hit_tokens = 0  # of those, tokens prefetched from HiCache's storage tier
        self.admitted = False
        self.retractions = 0
        self.finished_reason: FinishReason | None = None
        self.output_logprobs: list[float | None] = []
        self.output_top_logprobs: list[list[tuple[int, float]] | None] = []
        self.created_at = time.monotonic()
        self.first_token_at: float | None = None

    def __repr__(self) -> str:
        return f"Req({self.rid!r}, in={len(self.origin_input_ids)}, out={len(self.output_ids)}, kv={self.kv_len})"

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def all_token_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def reusable_ids(self) -> list[int]:
        """The tokens whose KV may come from the prefix cache: all but the last (it must
        run to produce logits), fewer when prompt logprobs or a mean-pooled embedding need
        positions computed."""
        limit = self.seq_len - 1
        if self.input_logprobs is not None:
            limit = self.input_logprobs.reuse_limit(self.seq_len)
        if self.pool is not None:
            limit = min(limit, self.pool.reuse_limit(self.seq_len))
        return self.all_token_ids()[:limit]

    def next_token_generator(self) -> torch.Generator | None:
        """The generator for drawing the next output token (None for greedy requests)."""
        return self.token_generator(len(self.output_ids))

    def token_generator(self, index: int) -> torch.Generator | None:
        """The generator for drawing output token ``index`` (a speculative step draws
        several tokens ahead of ``output_ids``); None for greedy requests."""
        if self._generator is not None:
            self._generator.manual_seed(position_seed(self.seed, index))
        return self._generator

    def reset_kv_state(self) -> None:
        """Forget all KV state (after release): the request owns nothing any more."""
        self.req_pool_idx = -1
        self.kv_len = 0
        self.kv_reserved_len = 0
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.last_loc = None
        self.extend_len = 0

    def append_token(self, token_id: int, context_len: int) -> None:
        """Record a sampled token and decide whether the request is finished."""
        self.output_ids.append(token_id)
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        params = self.sampling
        if self.grammar is not None and not self._advance_grammar(token_id):
            return
        if len(self.output_ids) >= params.min_new_tokens:
            if token_id in self.stop_token_set:
                self.finished_reason = FinishReason("stop", token_id)
                return
            if self._stop_text is not None:
                before = len(self._stop_text.text)
                self._stop_text.push([token_id])
                hit = find_stop(self._stop_text.text, params.stop, before)
                if hit:
                    self.finished_reason = FinishReason("stop", hit[1])
                    return
        elif self._stop_text is not None:
            self._stop_text.push([token_id])
        if len(self.output_ids) >= params.max_new_tokens or self.seq_len >= context_len:
            self.finished_reason = FinishReason("length")

    def _advance_grammar(self, token_id: int) -> bool:
        """Feed the token to the grammar; False when that finished the request (the grammar
        reached its end: ``stop``; or refused the token, which its mask prevents: abort)."""
        if not self.grammar.accept(token_id):
            self.abort(f"token {token_id} does not follow the request's {self.grammar.spec.kind}")
            return False
        if self.grammar.terminated:
            self.finished_reason = FinishReason("stop", token_id)
            return False
        return True

    def may_finish_on_next_token(self, context_len: int) -> bool:
        """Whether appending one more token could finish the request, whatever its id
        (False: only lengths decide, and they do not end it on that token)."""
        count = len(self.output_ids) + 1
        if count >= self.sampling.max_new_tokens or self.seq_len + 1 >= context_len:
            return True
        if self.grammar is not None:
            return True  # the grammar may end on it
        if count < self.sampling.min_new_tokens:
            return False  # stop tokens and strings are not checked yet
        return bool(self.stop_token_set) or self._stop_text is not None

    def abort(self, message: str, retryable: bool = False) -> None:
        self.finished_reason = FinishReason("abort", message=message, retryable=retryable)
