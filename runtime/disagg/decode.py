"""The decode role: pre-allocate each request's prompt KV, have the prefill write it there,
then decode it in the running batch.

Queues of one request::

    arrive -> pre-allocation queue (until its prompt's slots fit beside what the running
    requests will grow by) -> transfer queue (room claimed with those slots; the watcher
    polls the prefill) -> done: joins the running batch with the prefill's first token
                       -> failed / cancelled: aborted, its slots freed

A request aborted while its transfer may still run keeps its slots until the prefill says
the room ended (or cannot be reached for the timeout); after a failed room the slots wait
one more timeout (a write the prefill abandoned may still land within the engine's own
timeout, see ``KVTransport``): nothing may land in reused slots.
The decode keeps no prefix cache (every prompt's KV comes from the prefill), as SGLang.
Under tensor parallelism every rank pre-allocates the same slots (in lockstep, checked) and
receives its KV-head shard from the prefill rank of its number; rank 0 alone talks to the
prefills, for every rank, and shares how each room ended.
A constrained request's grammar compiles here while its KV travels; a request whose KV
arrived before its grammar compiled waits for it, slots held, before it joins the batch (the
first token, drawn under the same grammar on the prefill, is fed to it there). Prompt
logprobs come with the prefill's result.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from kvflow.runtime.config import EngineConfig
from kvflow.runtime.disagg.bootstrap_client import RoomReport
from kvflow.runtime.disagg.ranks import Endpoint
from kvflow.runtime.disagg.roles import KVRole, RoleStats
from kvflow.runtime.disagg.transport import KVTransferOptions
from kvflow.runtime.disagg.watcher import RoomWatcher
from kvflow.runtime.scheduler import Req, SchedulerPort
from kvflow.runtime.wire import TokenOutput
from kvflow.runtime.wire.disagg import PrefillResult, prompt_hash

__all__ = ["DecodeRole"]
logger = logging.getLogger("kvflow.decode")


def _grammar_ready(req: Req) -> bool:
    return req.grammar is None or req.grammar.ready


class DecodeRole(KVRole):
    """Owns the pre-allocation and transfer queues (SGLang's names), the requests whose KV
    arrived before their grammar compiled, and the slots quarantined after failures."""

    name = "decode"

    @classmethod
    def engine_config(cls, config: EngineConfig) -> EngineConfig:
        """Every prompt's KV comes from the prefill: no prefix cache here."""
        return dataclasses.replace(config, disable_radix_cache=True)

    def __init__(
        self,
        port: SchedulerPort,
        transfer: KVTransferOptions,
        wake: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(port, transfer, wake)
        timeout_s = transfer.timeout_s
        transport = self.transport
        self.vocab_size = port.model_config.vocab_size
        ranks = self.lockstep.gather(
            Endpoint(transport.session_id, self.layout, transport.peer_info())
        )
        # NOTE: rank 0 alone registers (every rank), claims and polls; the others hear
        # from it how each room ended (see _outcomes)
        self.watcher: RoomWatcher | None = None
        if self.lockstep.rank == 0:
            self.watcher = RoomWatcher(
                transport.session_id,
                self.layout,
                timeout_s,
                key=transfer.internal_key,
                peer_info=transport.peer_info(),
                tp_ranks=tuple(ranks[1:]),
                on_outcome=self.wake,  # the loop joins (or frees) the request at once
            )
        self.prealloc: list[Req] = []
        self.transferring: dict[str, Req] = {}
        self.abandoned: set[str] = set()  # aborted while their transfer may still write
        self.quarantine: list[tuple[float, Req]] = []  # (free at, request) after failures
        self.arrived: list[tuple[Req, RoomReport]] = []  # KV in, grammar still compiling
        self.timeout_s = timeout_s

    def info(self) -> dict[str, Any]:
        return {"kv_session": self.transport.session_id}

    def stats(self) -> RoleStats:
        return RoleStats(decode_prealloc=len(self.prealloc), decode_transfer=len(self.transferring))

    def admit(self, req: Req) -> None:
        if req.rid in self.transferring:
            raise ValueError(f"request {req.rid} is in flight already")
        self.port.check_fits(req)
        self.prealloc.append(req)

    def busy(self) -> bool:
        return bool(self.prealloc or self.transferring or self.quarantine or self.arrived)

    def abort(self, rid: str, message: str) -> TokenOutput | None:
        for req in self.prealloc:
            if req.rid == rid:
                self.prealloc.remove(req)
                return self.port.finish(req, message)
        for req, outcome in self.arrived:
            if req.rid == rid:
                self.arrived.remove((req, outcome))
                self.port.free(req)
                return self.port.finish(req, message)
        req = self.transferring.get(rid)
        if req is None or rid in self.abandoned:
            return None
        assert req.bootstrap is not None
        self.abandoned.add(rid)
        if self.watcher is not None:
            self.watcher.cancel(req.bootstrap)
        return self.port.finish(req, message)

    def poll(self) -> list[TokenOutput]:
        outputs: list[TokenOutput] = []
        now = self.lockstep.now()
        for free_at, req in [q for q in self.quarantine if q[0] <= now]:
            self.quarantine.remove((free_at, req))
            self.port.free(req)
        for key, outcome in self._outcomes():
            req = self.transferring.pop(key)
            if key in self.abandoned:
                self.abandoned.discard(key)
                self._release_after(outcome, req)
            elif outcome.state == "done":
                self.arrived.append((req, outcome))
            else:
                self._release_after(outcome, req)
                why = f"prefill failed: {outcome.message or outcome.state}"
                outputs.append(self.port.finish(req, why, retryable=True))
        ready = self.lockstep.all_true([_grammar_ready(req) for req, _ in self.arrived])
        for (req, outcome), yes in zip(list(self.arrived), ready, strict=True):
            if yes:
                self.arrived.remove((req, outcome))
                outputs += self._join(req, outcome.result)
        claims: list[tuple[Req, list[int]]] = []
        while self.prealloc and self.port.preallocate(self.prealloc[0]):
            req = self.prealloc.pop(0)
            # NOTE: zeroed before the claim: a slot the prefill does not write (a lying or
            # failing peer) reads as zeros, never as the KV of the request that had it
            claims.append((req, self.port.zero_prompt_slots(req)))
            self.transferring[req.rid] = req
        self._check_same_slots([slots for _, slots in claims])
        if self.watcher is not None:  # rank 0 claims for every rank
            for req, slots in claims:
                assert req.bootstrap is not None
                prompt = prompt_hash(req.origin_input_ids)
                self.watcher.claim(req.rid, req.bootstrap, slots, prompt)
        return outputs

    def _outcomes(self) -> list[tuple[str, RoomReport]]:
        """How rooms ended, as rank 0's watcher heard it: shared, so every rank frees or
        joins the same requests in the same step."""
        if not self.transferring:  # no room to hear of (so no collective, on every rank)
            return []
        heard = None if self.watcher is None else self.watcher.done()
        return self.lockstep.share(heard)  # type: ignore[no-any-return]

    def _check_same_slots(self, claims: list[list[int]]) -> None:
        """Prefill rank r writes into decode rank r at the slots rank 0 claimed: every
        rank must have reserved the same ones (they allocate in lockstep). A rank that
        drifted would take KV at the wrong place, so the group stops instead."""
        if self.lockstep.size == 1 or not claims:
            return
        flat = [slot for slots in claims for slot in slots]
        low = self.lockstep.all_min(flat + [-slot for slot in flat])
        if low[: len(flat)] != [-v for v in low[len(flat) :]]:
            raise RuntimeError(
                "the decode's tensor-parallel ranks reserved different KV slots for the same "
                "requests (out of lockstep)"
            )

    def _join(self, req: Req, body: dict[str, Any]) -> list[TokenOutput]:
        """A request whose prompt KV arrived joins the running batch with the prefill's
        first token (or ends here: its grammar failed to compile, or the prefill's result
        is not one this contract allows)."""
        if req.grammar is not None and req.grammar.error is not None:
            self.port.free(req)
            return [self.port.finish(req, req.grammar.error)]
        try:
            wants_token = req.sampling.max_new_tokens > 0
            result = PrefillResult.from_json(body, self.vocab_size, wants_token=wants_token)
            if result.cached_tokens > len(req.origin_input_ids):
                raise ValueError(f"cached_tokens {result.cached_tokens} exceed the prompt")
            if req.input_logprobs is not None and result.input_logprobs is not None:
                tops = (
                    None if result.input_top_logprobs is None else list(result.input_top_logprobs)
                )
                req.input_logprobs.fill(list(result.input_logprobs), tops)
        except Exception as err:  # nothing a peer sends may end the scheduler loop
            logger.warning("room of %s: the prefill's result is refused: %s", req.rid, err)
            self.port.free(req)
            return [self.port.finish(req, f"the prefill's result is invalid: {err}", True)]
        top = list(result.top_logprobs) if result.top_logprobs else None
        req.cached_tokens = result.cached_tokens
        return self.port.join_running(req, result.first_token, result.logprob, top)

    def _release_after(self, outcome: RoomReport, req: Req) -> None:
        """Free the slots of a room that ended; after a failure, one timeout later."""
        if outcome.state == "failed":
            self.quarantine.append((self.lockstep.now() + self.timeout_s, req))
        else:
            self.port.free(req)
