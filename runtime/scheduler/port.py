"""The scheduler's port for the prefill/decode roles: the few things a role may do to it.

A role (:mod:`kvflow.runtime.disagg`) owns its own queues and moves requests between them
and the scheduler only through this port::

    prefill:  admit -> (scheduler prefills) -> take_parked -> (KV sent) -> release
    decode:   check_fits -> preallocate -> zero_prompt_slots -> (KV received) -> join_running
              (or free, for a request that never joins)

Nothing else of the scheduler (its queues, budgets, KV manager, model runner) is reached
from a role.
"""

from __future__ import annotations

from typing import Any

from kvflow.runtime.core import Req
from kvflow.runtime.scheduler.scheduler import Scheduler
from kvflow.runtime.wire import TokenOutput

__all__ = ["SchedulerPort"]


class SchedulerPort:
    """A role's narrow view of one :class:`Scheduler` (same thread: not thread-safe)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        runner = scheduler.runner
        self.kv_pool = runner.kv_pool  # what the KV layout describes to peers
        self.model_config = runner.model_config
        self.kv_heads = runner.heads.num_kv_heads  # this rank's share under TP
        self.page_size = runner.page_size
        # an EAGLE target's features, a row per KV slot (None: none kept), sent and
        # received with the KV, and what a row holds (what peers compare)
        self.feature_pool = runner.hidden_pool
        self.feature_kind = ""
        if runner.hidden_pool is not None and runner.features is not None:
            dtype = str(runner.hidden_pool.dtype).removeprefix("torch.")
            self.feature_kind = runner.features.label(dtype)
        # what the ranks of a tensor-parallel group must decide alike (a no-op for one rank)
        self.lockstep = scheduler.lockstep
        # decode: pre-allocated requests not yet running, by rid -> their LoRA adapter
        self._joining: dict[str, str | None] = {}

    # -- both roles ------------------------------------------------------------------------
    def check_fits(self, req: Req) -> None:
        """Raise ValueError if the request can never run here (see ``Scheduler``)."""
        self._scheduler.check_fits(req)

    def prompt_slots(self, req: Req, end: int, begin: int = 0) -> list[int]:
        """The KV slots of prompt positions ``begin .. end - 1`` as the request's row says."""
        return self._scheduler.runner.req_to_token.read(req.req_pool_idx, end, begin).tolist()

    def finish(self, req: Req, message: str, retryable: bool = False) -> TokenOutput:
        """Abort a request the role holds (its KV, if any, is the role's to free)."""
        req.abort(message, retryable)
        return self._scheduler.make_output(req, [])

    # -- prefill ---------------------------------------------------------------------------
    def admit(self, req: Req) -> None:
        """Queue a request for prefill; ValueError if it can never fit."""
        self._scheduler.add_request(req)

    @property
    def chunked(self) -> Req | None:
        """The request being prefilled chunk by chunk (its cached prefix may go out early)."""
        return self._scheduler.chunked

    def take_parked(self) -> list[Req]:
        """Requests that finished with a bootstrap room since the last call: their KV stays
        locked in their rows until :meth:`release` (the scheduler parks them only when
        built with ``park_finished``)."""
        parked, self._scheduler.parked = self._scheduler.parked, []
        return parked

    def release(self, req: Req) -> None:
        """A parked request's KV was sent (or given up on): cache it as any finished one."""
        self._scheduler.cache.cache_finished_req(req)

    # -- decode ----------------------------------------------------------------------------
    def preallocate(self, req: Req) -> bool:
        """Take a row and slots for the whole prompt if they fit beside the running
        requests' reserved growth; nothing is taken otherwise."""
        sched = self._scheduler
        lora = sched.runner.lora
        if lora is not None:  # its adapter needs a device slot beside the others in flight
            adapters = {r.lora_path for r in sched.running} | set(self._joining.values())
            if not lora.fits(adapters | {req.lora_path}):
                return False
        kv = sched.kv
        prompt_len = len(req.origin_input_ids)
        reserved = sum(sched.reserve(r) for r in sched.running)
        if kv.available_tokens() - reserved < prompt_len + kv.page_size:
            return False
        if not kv.admit(req):
            return False
        if kv.grow(req, prompt_len) is None:
            sched.cache.release_req(req)
            return False
        self._joining[req.rid] = req.lora_path
        return True

    def zero_prompt_slots(self, req: Req) -> list[int]:
        """Zero the KV of a pre-allocated request's prompt slots (every layer, K and V, and
        an EAGLE target's features) and return them: what the prefill does not write there
        reads as zeros, never as another request's KV."""
        slots = self._scheduler.runner.req_to_token.read(
            req.req_pool_idx, len(req.origin_input_ids)
        )
        extra = () if self.feature_pool is None else (self.feature_pool,)
        self.kv_pool.zero_slots(slots, extra)
        return slots.tolist()

    def free(self, req: Req) -> None:
        """Give back a pre-allocated request's row and slots (it never joins)."""
        self._joining.pop(req.rid, None)
        self._scheduler.cache.release_req(req)

    def join_running(
        self, req: Req, first_token: int | None, logprob: float | None, top: Any
    ) -> list[TokenOutput]:
        """A pre-allocated request whose prompt KV arrived joins the running batch with the
        prefill's first token (``None``: the prefill sampled none, it ends here)."""
        self._joining.pop(req.rid, None)
        return self._scheduler.add_prefilled(req, first_token, logprob, top)
