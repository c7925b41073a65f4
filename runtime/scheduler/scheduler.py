"""The scheduler: waiting queue, running batch, prefill admission, decode, retraction, abort.

One call of :meth:`Scheduler.step` runs one forward pass: a prefill batch when new work
can be admitted (chunked prefill continues first), otherwise one decode step of every
running request. It is used in-process by ``Engine`` and inside the scheduler process
by the server.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvflow.runtime.cache.factory import make_prefix_cache
from kvflow.runtime.config import EngineConfig
from kvflow.runtime.core import Req
from kvflow.runtime.distributed.lockstep import Lockstep
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.host_copy import host_to_device
from kvflow.runtime.model_runner import ModelRunner
from kvflow.runtime.sampling import PendingSample, SampleOutput, SamplingBatch
from kvflow.runtime.scheduler.batch import build_decode_batch, build_extend_batch
from kvflow.runtime.scheduler.budget import RESERVE_CLIP, PrefillBudget
from kvflow.runtime.scheduler.kv import DecodeGrowth, KVManager
from kvflow.runtime.scheduler.policy import order_waiting
from kvflow.runtime.scheduler.sharing import BatchPrefixes
from kvflow.runtime.scheduler.verify import make_spec_worker
from kvflow.runtime.wire import FinishReason, TokenOutput

__all__ = ["Scheduler"]
logger = logging.getLogger(__name__)

# New-token ratio: the share of a running request's remaining max_new_tokens reserved
# when admitting more work. Starts optimistic, decays each decode step, and jumps up
# after a retraction (we were too optimistic).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RETRACT_NEW_TOKEN_RATIO = 0.9
# With nothing else to run, a step waits this long for a grammar compile to end.
GRAMMAR_IDLE_WAIT_S = 0.002
# ... or for a HiCache storage prefetch to end.
STORAGE_IDLE_WAIT_S = 0.002


class _NextDecode(NamedTuple):
    """The next decode step, built while the GPU ran the one before (see ``_prepare_next``)."""

    reqs: list[Req]
    fb: ForwardBatch  # its input ids are the previous step's sampled ids, still on the GPU
    growth: DecodeGrowth
    logits: torch.Tensor | None  # set when its forward was launched already


class Scheduler:
    """Owns every request from arrival to finish; not thread-safe (one loop drives it).

    NOTE: after launching a decode step, the scheduler builds the next one (KV slots,
    positions, CUDA-graph inputs) before it waits for the sampled tokens, assuming every
    request goes on; when no request can finish on the token being sampled (only lengths
    could end them, and they do not), it also launches that step's forward, so the GPU
    never waits for the host. The step built ahead is used only if every request went on
    and no prefill is due; otherwise it is undone exactly (``_drop_next``) before anything
    else touches memory. A forward launched for it writes only KV at the slots it took
    (past each request's ``kv_len``, never in a cached page), ordered on the stream before
    whatever reuses them. Results never depend on it; ``prepare_next_decode = False`` turns
    it off, ``launch_ahead = False`` keeps the building but not the early launch.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        *,
        park_finished: bool = False,
        lockstep: Lockstep | None = None,
        isolate_failures: bool = True,
    ) -> None:
        self.config = config
        self.runner = runner
        # Under tensor parallelism, the clock and async events every rank agrees on.
        self.lockstep = lockstep or Lockstep()
        # A failed step aborts its batch and the scheduler goes on; off, it raises (a rank
        # of a tensor-parallel group cannot go on alone: the others did not fail with it).
        self.isolate_failures = isolate_failures
        self.cache = make_prefix_cache(config, runner, self.lockstep)
        self.kv = KVManager(runner.req_to_token, runner.allocator, self.cache)
        self.waiting: list[Req] = []
        self.grammar_wait: list[Req] = []  # their grammar compiles (kvflow.runtime.grammar)
        self.storage_wait: list[Req] = []  # their prefix is read from HiCache's storage tier
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0
        self.forward_steps = 0
        self.generated_tokens = 0
        self.prepare_next_decode = True
        self.launch_ahead = runner.device.startswith("cuda")  # on CPU it would only reorder
        self._next: _NextDecode | None = None
        self._batch: list[Req] = []  # the requests of the step being run (for _fail_batch)
        # the waiting request being matched or admitted: an error there ends it (else it
        # would stay first in the queue and fail the same way on every step)
        self._planning: Req | None = None
        # Prefill role: finished requests with a bootstrap room keep their KV locked and
        # wait here for the role to take them (SchedulerPort.take_parked).
        self.park_finished = park_finished
        self.parked: list[Req] = []
        # Speculative decoding (--speculative-algorithm): verify steps replace decode steps
        # (never built ahead: the step after depends on how many drafts were accepted).
        self.spec = make_spec_worker(config, runner, self.kv)
        if self.spec is not None:
            self.prepare_next_decode = self.launch_ahead = False

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request; raises ValueError if it can never fit."""
        self.check_fits(req)
        req.created_at = self.lockstep.now()
        if req.grammar is not None:  # even if compiled: a failed compile aborts it there
            self.grammar_wait.append(req)
        elif self.cache.start_prefetch(req):
            self.storage_wait.append(req)
        else:
            self.waiting.append(req)

    def check_fits(self, req: Req) -> None:
        """Raise ValueError if the request can never run here (empty, or too long)."""
        context_len = self.runner.context_len
        if not req.origin_input_ids:
            raise ValueError("the prompt is empty")
        if (req.pool is not None) != self.config.is_embedding:
            raise ValueError(
                "an embedding server embeds only"
                if self.config.is_embedding
                else "this server does not serve embeddings (--is-embedding)"
            )
        if len(req.origin_input_ids) + req.sampling.max_new_tokens > context_len:
            raise ValueError(
                f"prompt ({len(req.origin_input_ids)} tokens) + max_new_tokens "
                f"({req.sampling.max_new_tokens}) exceeds the context length ({context_len})"
            )
        if len(req.origin_input_ids) + req.sampling.max_new_tokens > self.runner.allocator.size:
            raise ValueError("prompt + max_new_tokens exceeds the whole KV cache")

    def abort_request(self, rid: str, message: str = "aborted by the client") -> TokenOutput | None:
        """Abort a waiting or running request, releasing its memory. None if unknown."""
        self._drop_next()
        for queue in (self.waiting, self.grammar_wait, self.storage_wait):
            req = next((r for r in queue if r.rid == rid), None)
            if req is not None:
                queue.remove(req)
                req.abort(message)
                return self.make_output(req, [])
        for active in [*self.running, *([self.chunked] if self.chunked else [])]:
            if active.rid == rid:
                self._forget_draft(active)
                self.cache.release_req(active)
                if active is self.chunked:
                    self.chunked = None
                else:
                    self.running.remove(active)
                active.abort(message)
                return self.make_output(active, [])
        return None

    def has_work(self) -> bool:
        return bool(
            self.waiting or self.running or self.chunked or self.grammar_wait or self.storage_wait
        )

    def num_requests(self) -> int:
        return (
            len(self.waiting)
            + len(self.running)
            + (1 if self.chunked else 0)
            + len(self.grammar_wait)
            + len(self.storage_wait)
        )

    def requests_on_adapter(self, name: str) -> int:
        """Requests in flight here (queued, running, parked) on LoRA adapter ``name``."""
        reqs = [*self.waiting, *self.running, *self.grammar_wait, *self.storage_wait]
        reqs += [*self.parked, *([self.chunked] if self.chunked else [])]
        return sum(req.lora_path == name for req in reqs)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while any request is in flight."""
        if self.has_work():
            return False
        self.cache.evict(self.cache.total_size())
        self.cache.reset()
        return True

    def _forget_draft(self, req: Req) -> None:
        if self.spec is not None:
            self.spec.forget(req)

    def _release_finished(self, req: Req) -> None:
        self._forget_draft(req)
        if self.park_finished and req.bootstrap is not None:
            self.parked.append(req)  # its KV stays locked in its row until released
        else:
            self.cache.cache_finished_req(req)

    def add_prefilled(
        self, req: Req, first_token: int | None, logprob: float | None, top: list | None
    ) -> list[TokenOutput]:
        """Decode role: a request whose prompt KV arrived in its row (all positions) joins
        the running batch with the first token the prefill sampled; ``None`` when the
        prefill sampled none (``max_new_tokens`` 0)."""
        req.kv_len = len(req.origin_input_ids)
        req.admitted = True
        if first_token is None:
            req.finished_reason = FinishReason("length")
            self.cache.cache_finished_req(req)
            return [self.make_output(req, [])]
        return self._commit([req], SampleOutput([first_token], [logprob], [top]))

    # -- one step --------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Run one forward pass and return what each request in it produced.

        A step that raises does not take the scheduler down: the requests of the failed
        batch end with an ``abort`` naming the error, their KV (taken slots included) is
        freed, and every other request goes on (see :meth:`_fail_batch`); with
        ``isolate_failures`` off, the error propagates.
        """
        self._batch, self._planning = [], None
        refused = self._poll_grammars()
        self._poll_storage()
        try:
            return refused + self._step()
        except Exception as err:
            if not self.isolate_failures:
                raise
            logger.exception("a step failed; aborting its %d request(s)", len(self._batch))
            return refused + self._fail_batch(err)

    def _poll_grammars(self) -> list[TokenOutput]:
        """Requests whose grammar compiled join the waiting queue; a failed compile ends its
        request. With nothing else to run, wait briefly for a compile instead of spinning."""
        if not self.grammar_wait:
            return []
        if not (self.waiting or self.running or self.chunked):
            futures = [r.grammar.future for r in self.grammar_wait]
            concurrent.futures.wait(futures, GRAMMAR_IDLE_WAIT_S, "FIRST_COMPLETED")
        outputs = []
        ready = self.lockstep.all_true([r.grammar.ready for r in self.grammar_wait])
        for req in [r for r, done in zip(self.grammar_wait, ready, strict=True) if done]:
            self.grammar_wait.remove(req)
            if req.grammar.error is None:
                self.waiting.append(req)
            else:
                req.abort(req.grammar.error)
                outputs.append(self.make_output(req, []))
        return outputs

    def _poll_storage(self) -> None:
        """Requests whose storage prefetch ended (or ran out of time) join the waiting
        queue; with nothing else to run, wait briefly instead of spinning."""
        if self.storage_wait and not (self.waiting or self.running or self.chunked):
            time.sleep(STORAGE_IDLE_WAIT_S)
        for req in self.cache.poll():
            if req in self.storage_wait:
                self.storage_wait.remove(req)
                self.waiting.append(req)

    def _fail_batch(self, err: Exception) -> list[TokenOutput]:
        """End every request of the failed step with an error and give back its memory."""
        try:
            self._drop_next()
        except Exception:  # the step ahead may be half built; its requests are freed below
            self._next = None
        outputs = []
        if self._planning is not None and all(r is not self._planning for r in self._batch):
            self._batch.append(self._planning)
        self._planning = None
        failed = {id(r) for r in self._batch}
        self.running = [r for r in self.running if id(r) not in failed]
        self.waiting = [r for r in self.waiting if id(r) not in failed]
        if self.chunked is not None and id(self.chunked) in failed:
            self.chunked = None
        for req in self._batch:
            self._forget_draft(req)
            if req.req_pool_idx >= 0:
                self.cache.release_req(req)
            if not req.finished:
                req.abort(f"internal error while running the batch: {type(err).__name__}: {err}")
            outputs.append(self.make_output(req, []))
        self._batch = []
        return outputs

    def _step(self) -> list[TokenOutput]:
        if self.waiting or self.chunked is not None:
            self._drop_next()  # a prefill may be planned: its budget sees all free memory
        plan = self._plan_prefill()
        if plan:
            return self._run_embed(plan) if self.config.is_embedding else self._run_extend(plan)
        if self.running:
            return self._run_decode() if self.spec is None else self._run_verify()
        return []

    def reserve(self, req: Req) -> int:
        """KV tokens kept back for a running request's future output."""
        remaining = req.sampling.max_new_tokens - len(req.output_ids)
        return int(min(max(remaining, 0), RESERVE_CLIP) * self.new_token_ratio)

    def _plan_prefill(self) -> list[tuple[Req, int]]:
        if not self.waiting and self.chunked is None:
            return []
        cfg = self.config
        mixing = cfg.enable_mixed_chunk and bool(self.running)
        chunk = cfg.mixed_chunk_size if mixing else cfg.chunked_prefill_size
        kv_tokens = self.kv.available_tokens() - sum(self.reserve(r) for r in self.running)
        if mixing:  # the running requests' next tokens run in the same step
            kv_tokens -= sum(self.kv.tokens_to_grow(r, 1) for r in self.running)
        budget = PrefillBudget(
            input_tokens=min(cfg.max_prefill_tokens, chunk) if mixing else cfg.max_prefill_tokens,
            chunk_tokens=chunk if chunk > 0 else None,
            kv_tokens=kv_tokens,
            requests=cfg.max_running_requests - len(self.running),
            page_size=self.kv.page_size,
        )
        plan: list[tuple[Req, int]] = []
        batch_prefixes = BatchPrefixes()
        if self.chunked is not None:
            req = self.chunked
            take = budget.plan(req.seq_len - req.kv_len, self.reserve(req))
            if take == 0:
                return []  # memory is short: decode (and maybe retract) first
            budget.consume(take, self.reserve(req), take == req.seq_len - req.kv_len)
            plan.append((req, take))
            self._batch.append(req)
            batch_prefixes.add(req)
            self.chunked = None
            if take < req.seq_len - req.kv_len:
                return self._allocate(plan)
        radix = not cfg.disable_radix_cache
        matched: dict[str, int] = {}

        def match_len(req: Req) -> int:  # once per request per round (lpm orders by it too)
            if req.rid not in matched:
                self._planning = req  # (lpm matches every waiting request before the loop)
                matched[req.rid] = self.kv.match(req)
            return matched[req.rid]

        now = self.lockstep.now()
        # LoRA: the step's adapters (the running requests' too, which decode with it or
        # right after) must each get one of the --max-loras-per-batch device slots
        adapters = {r.lora_path for r in self.running} | {r.lora_path for r, _ in plan}
        lora = self.runner.lora
        for req in order_waiting(cfg.schedule_policy, self.waiting, match_len, now):
            self._planning = req
            if lora is not None and not lora.fits(adapters | {req.lora_path}):
                continue  # its adapter waits for a slot; requests on resident ones go on
            cached = match_len(req)
            if radix and batch_prefixes.should_wait(req, cached):
                continue  # a request in this batch caches its prefix: it hits next step
            extend_len = req.seq_len - cached
            take = budget.plan(extend_len, self.reserve(req))
            if take == 0 or not self.kv.admit(req):
                break
            extend_len = req.seq_len - req.kv_len
            take = min(take, extend_len)
            budget.consume(take, self.reserve(req), take == extend_len)
            self.waiting.remove(req)
            adapters.add(req.lora_path)
            plan.append((req, take))
            self._batch.append(req)
            batch_prefixes.add(req)
            if take < extend_len:
                break  # one chunked request per batch, and it ends the batch
        self._planning = None
        return self._allocate(plan)

    def _allocate(self, plan: list[tuple[Req, int]]) -> list[tuple[Req, int]]:
        kept = []
        for req, take in plan:
            if self.kv.grow(req, take) is None:
                logger.warning("KV allocation failed for %s; back to the queue", req.rid)
                self.cache.release_req(req)
                self.waiting.insert(0, req)
                continue
            kept.append((req, take))
        self._batch = [req for req, _ in kept]  # until the step's batch is complete
        return kept

    def _mixed_decodes(self) -> tuple[list[Req], torch.Tensor | None]:
        """The running requests whose next token joins this prefill step (mixed chunked
        prefill), with their new KV slots; none when mixing is off or memory is short."""
        if not self.config.enable_mixed_chunk or not self.running:
            return [], None
        reqs = list(self.running)
        if sum(self.kv.tokens_to_grow(r, 1) for r in reqs) > self.kv.available_tokens():
            return [], None  # they decode on their own once memory is made
        return reqs, self.kv.grow_decode(reqs)

    def _run_extend(self, plan: list[tuple[Req, int]]) -> list[TokenOutput]:
        decodes, decode_slots = self._mixed_decodes()
        self._batch = [req for req, _ in plan] + decodes
        reqs = self._batch
        extend_lens = [take for _, take in plan] + [1] * len(decodes)
        slots = [
            self.runner.req_to_token.read(r.req_pool_idx, r.kv_len + n, r.kv_len) for r, n in plan
        ]
        if decode_slots is not None:
            slots.append(decode_slots.to(torch.int64))
        extras = [
            r.input_logprobs.extra_rows(r.kv_len, n) if r.input_logprobs else 0 for r, n in plan
        ]
        fb = build_extend_batch(
            reqs, extend_lens, torch.cat(slots), self.runner.device, extras + [0] * len(decodes)
        )
        logits = self.runner.forward(fb)
        self.forward_steps += 1
        last_rows = fb.last_logit_rows()
        to_sample: list[int] = []
        outputs: list[TokenOutput] = []
        for row, (req, take) in enumerate(plan):
            if req.input_logprobs is not None:  # prompt logprobs: rows up to the last one
                first = last_rows[row] - extras[row]
                position = req.kv_len + take - 1 - extras[row]
                req.input_logprobs.record(logits[first : last_rows[row] + 1], position)
            req.kv_len += take
            if req.kv_len < req.seq_len:
                self.cache.cache_unfinished_req(req)
                self.chunked = req
            elif len(req.output_ids) >= req.sampling.max_new_tokens:
                req.finished_reason = req.finished_reason or FinishReason("length")
                self._release_finished(req)
                outputs.append(self.make_output(req, []))
            else:
                # Share the prompt at once (not only when the request finishes), so requests
                # with the same prefix admitted from now on hit the cache.
                self.cache.cache_unfinished_req(req)
                to_sample.append(row)
        for row, req in enumerate(decodes, start=len(plan)):
            req.kv_len += 1
            to_sample.append(row)
        if to_sample:
            sampled_reqs = [reqs[i] for i in to_sample]
            pending = self._launch_sample(sampled_reqs, logits[[last_rows[i] for i in to_sample]])
            outputs += self._commit(sampled_reqs, pending.resolve())
        return outputs

    def _run_embed(self, plan: list[tuple[Req, int]]) -> list[TokenOutput]:
        """An embedding server's prefill step: each request pools the hidden states of its
        new tokens and ends with its embedding once its prompt is done (nothing sampled;
        its prompt's KV goes to the prefix cache like any finished request's)."""
        reqs = self._batch = [req for req, _ in plan]
        slots = [
            self.runner.req_to_token.read(r.req_pool_idx, r.kv_len + n, r.kv_len) for r, n in plan
        ]
        fb = build_extend_batch(reqs, [n for _, n in plan], torch.cat(slots), self.runner.device)
        hidden = self.runner.forward_hidden(fb)
        self.forward_steps += 1
        outputs, start = [], 0
        for req, take in plan:
            req.pool.add(hidden[start : start + take])
            start += take
            req.kv_len += take
            if req.kv_len < req.seq_len:
                self.cache.cache_unfinished_req(req)
                self.chunked = req
            else:
                req.finished_reason = FinishReason("length")
                self.cache.cache_finished_req(req)
                outputs.append(self.make_output(req, []))
        return outputs

    def _run_decode(self) -> list[TokenOutput]:
        built, self._next = self._next, None
        # requests that joined after the step was launched ahead (a PD decode's arrivals)
        # decode from the next step: the launched forward is not thrown away for them
        joined = (
            built is not None
            and built.logits is not None
            and len(self.running) > len(built.reqs)
            and all(a is b for a, b in zip(built.reqs, self.running, strict=False))
        )
        if built is not None and (joined or built.reqs == self.running):
            reqs, outputs = built.reqs, []
            self._batch = reqs
            logits = self.runner.forward(built.fb) if built.logits is None else built.logits
        else:
            if built is not None:
                self.kv.undo_grow(built.growth)
            outputs = self._make_room_for_decode()
            if not self.running:
                return outputs
            reqs = list(self.running)
            self._batch = reqs
            fb = build_decode_batch(reqs, self.kv.grow_decode(reqs), self.runner.device)
            logits = self.runner.forward(fb)
        self.forward_steps += 1
        for req in reqs:
            req.kv_len += 1
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        pending = self._launch_sample(reqs, logits)
        self._prepare_next(reqs, pending, self.running[len(reqs) :] if joined else [])
        return outputs + self._commit(reqs, pending.resolve())

    def _run_verify(self) -> list[TokenOutput]:
        """A speculative step in place of a decode step: every running request verifies its
        draft (if any) in one forward and keeps one or more tokens (``SpecWorker``)."""
        outputs = self._make_room_for_decode()
        if not self.running:
            return outputs
        assert self.spec is not None
        reqs = self._batch = list(self.running)
        steps = self.spec.run(reqs)
        self.forward_steps += 1
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        for req, step in zip(reqs, steps, strict=True):
            start = req.kv_len
            kept = 0
            for token in step.tokens:
                kept += 1
                try:
                    req.append_token(token, self.runner.context_len)
                except Exception as err:  # isolated: this request fails, the batch goes on
                    logger.exception("request %s failed on token %d", req.rid, token)
                    req.abort(f"internal error: {type(err).__name__}: {err}")
                if req.finished:  # a stop, EOS or length inside the accepted tokens
                    break
            req.kv_len = start + kept
            self.spec.settle(req, kept)
            self.generated_tokens += kept
            if req.return_logprob:
                req.output_logprobs += step.logprobs[:kept]
                req.output_top_logprobs += step.top_logprobs[:kept]
            if req.finished:
                self._release_finished(req)
            out = self.make_output(req, step.tokens[:kept])
            if req.return_logprob:
                out = dataclasses.replace(
                    out,
                    new_logprobs=step.logprobs[:kept],
                    new_top_logprobs=step.top_logprobs[:kept],
                )
            outputs.append(out)
        self.running = [r for r in self.running if not r.finished]
        return outputs

    def _prepare_next(
        self, reqs: list[Req], pending: PendingSample, joining: list[Req] | None = None
    ) -> None:
        """Build (and maybe launch) the decode step after this one while the GPU still runs
        this one; called after this step's sampling is queued, which reads the logits
        buffer that the next graph replay overwrites. ``joining``: running requests that
        were not in this step (they feed their last token, already on the host)."""
        if not self.prepare_next_decode or self.waiting or self.chunked is not None:
            return
        input_ids = pending.next_token_ids
        if joining:
            last = host_to_device([r.output_ids[-1] for r in joining], self.runner.device)
            input_ids = torch.cat((input_ids, last.to(input_ids.dtype)))
            reqs = reqs + joining
        context_len = self.runner.context_len
        may_finish = [r.may_finish_on_next_token(context_len) for r in reqs]
        if any(
            len(r.output_ids) + 1 >= r.sampling.max_new_tokens or r.seq_len + 1 >= context_len
            for r in reqs
        ):
            return  # a request ends by length on this token: the step would be undone
        growth = self.kv.try_grow_decode(reqs)
        if growth is None:
            return
        fb = build_decode_batch(reqs, growth.out_cache_loc, self.runner.device, input_ids)
        self.runner.prepare(fb)
        logits = None
        if self.launch_ahead and not any(may_finish):
            logits = self.runner.forward(fb)
        self._next = _NextDecode(reqs, fb, growth, logits)

    def _drop_next(self) -> None:
        """Undo the step built ahead (its KV slots go back as they were taken)."""
        if self._next is not None:
            self.kv.undo_grow(self._next.growth)
            self._next = None

    def _make_room_for_decode(self) -> list[TokenOutput]:
        """Retract running requests until every remaining one can grow by a token."""
        outputs: list[TokenOutput] = []
        while self.running:
            need = sum(self.kv.tokens_to_grow(r, 1) for r in self.running)
            if need <= self.kv.available_tokens():
                break
            if len(self.running) == 1:
                req = self.running.pop()
                self._forget_draft(req)
                self.cache.release_req(req)
                req.abort("the KV cache is too small for this request")
                outputs.append(self.make_output(req, []))
                break
            # Retract the request with the least output (and longest prompt): its KV is
            # the cheapest to rebuild relative to the memory it frees.
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            self.running.remove(victim)
            self._forget_draft(victim)
            self.cache.release_req(victim)
            victim.retractions += 1
            self.num_retractions += 1
            self.waiting.insert(0, victim)
            self.new_token_ratio = max(self.new_token_ratio, RETRACT_NEW_TOKEN_RATIO)
            logger.info("retracted %s (%d output tokens kept)", victim.rid, len(victim.output_ids))
        return outputs

    def _launch_sample(self, reqs: Sequence[Req], logits: torch.Tensor) -> PendingSample:
        batch = SamplingBatch.from_reqs(reqs, self.runner.vocab_size, self.runner.device)
        return self.runner.sampler.launch(logits, batch)

    def _commit(self, reqs: Sequence[Req], sampled: SampleOutput) -> list[TokenOutput]:
        """Record one sampled token per request; finished requests leave (and release their
        KV), unfinished ones not yet running join the running batch."""
        outputs = []
        self.generated_tokens += len(reqs)
        running = {id(r) for r in self.running}
        for row, req in enumerate(reqs):
            token = sampled.next_token_ids[row]
            try:
                req.append_token(token, self.runner.context_len)
            except Exception as err:  # isolated: this request fails, the batch goes on
                logger.exception("request %s failed on token %d", req.rid, token)
                req.abort(f"internal error: {type(err).__name__}: {err}")
            if req.return_logprob:
                req.output_logprobs.append(sampled.logprobs[row])
                req.output_top_logprobs.append(sampled.top_logprobs[row])
            if req.finished:
                self._drop_next()  # built for a batch that no longer exists
                self._release_finished(req)
            elif id(req) not in running:
                self.running.append(req)
            outputs.append(
                self.make_output(req, [token], sampled.logprobs[row], sampled.top_logprobs[row])
            )
        if any(r.finished for r in reqs):
            self.running = [r for r in self.running if not r.finished]
        return outputs

    @staticmethod
    def make_output(
        req: Req,
        new_ids: list[int],
        logprob: float | None = None,
        top: list[tuple[int, float]] | None = None,
    ) -> TokenOutput:
        prompt = req.input_logprobs.take() if req.input_logprobs is not None else None
        return TokenOutput(
            rid=req.rid,
            new_token_ids=new_ids,
            finish_reason=req.finished_reason,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            new_logprobs=[logprob] * len(new_ids) if req.return_logprob else [],
            new_top_logprobs=[top] * len(new_ids) if req.return_logprob else [],
            input_logprobs=prompt[0] if prompt else None,
            input_top_logprobs=prompt[1] if prompt else None,
            embedding=_embedding(req),
        )


def _embedding(req: Req) -> list[float] | None:
    """A finished embedding request's embedding (None for others and for aborted ones)."""
    if req.pool is None or req.finished_reason != FinishReason("length"):
        return None
    return req.pool.result()
