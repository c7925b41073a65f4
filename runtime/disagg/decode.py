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
A constrained request's grammar compiles here while its KV travels; a request whose KV
arrived before its grammar compiled waits for it, slots held, before it joins the batch (the
first token, drawn under the same grammar on the prefill, is fed to it there). Prompt
logprobs come with the prefill's result.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvflow.runtime.disagg.layout import layout_of
from kvflow.runtime.disagg.roles import Role, RoleStats
from kvflow.runtime.disagg.transport import KVTransport
from kvflow.runtime.disagg.watcher import Outcome, RoomWatcher
from kvflow.runtime.scheduler import Req, Scheduler
from kvflow.runtime.wire import TokenOutput

__all__ = ["DecodeRole"]
logger = logging.getLogger("kvflow.decode")


def _grammar_ready(req: Req) -> bool:
    return req.grammar is None or req.grammar.ready


class DecodeRole(Role):
    def __init__(self, scheduler: Scheduler, *, transport: KVTransport, timeout_s: float) -> None:
        super().__init__(scheduler)
        runner = scheduler.runner
        self.transport = transport
        self.layout = layout_of(runner.kv_pool, runner.model_config, runner.page_size)
        for region in self.layout.regions():
            transport.register(region.ptr, region.nbytes)
        self.watcher = RoomWatcher(transport.session_id, self.layout, timeout_s)
        self.watcher.start()
        self.prealloc: list[Req] = []
        self.transferring: dict[str, Req] = {}
        self.abandoned: set[str] = set()  # aborted while their transfer may still write
        self.quarantine: list[tuple[float, Req]] = []  # (free at, request) after failures
        self.arrived: list[tuple[Req, Outcome]] = []  # KV in, grammar still compiling
        self.timeout_s = timeout_s

    def info(self) -> dict[str, Any]:
        return {"kv_session": self.transport.session_id}

    def stats(self) -> RoleStats:
        return RoleStats(decode_prealloc=len(self.prealloc), decode_transfer=len(self.transferring))

    def add(self, req: Req) -> None:
        if req.bootstrap is None:
            raise ValueError(
                "this server runs the decode role: requests come through a PD router with "
                "bootstrap_host, bootstrap_port and bootstrap_room"
            )
        if req.rid in self.transferring:
            raise ValueError(f"request {req.rid} is in flight already")
        self.scheduler.check_fits(req)
        self.prealloc.append(req)

    def busy(self) -> bool:
        return bool(self.prealloc or self.transferring or self.quarantine or self.arrived)

    def abort(self, rid: str, message: str) -> TokenOutput | None:
        for req in self.prealloc:
            if req.rid == rid:
                self.prealloc.remove(req)
                req.abort(message)
                return self.scheduler.make_output(req, [])
        for req, outcome in self.arrived:
            if req.rid == rid:
                self.arrived.remove((req, outcome))
                self.scheduler.cache.release_req(req)
                req.abort(message)
                return self.scheduler.make_output(req, [])
        req = self.transferring.get(rid)
        if req is None or rid in self.abandoned:
            return None
        assert req.bootstrap is not None
        self.abandoned.add(rid)
        self.watcher.cancel(req.bootstrap)
        req.abort(message)
        return self.scheduler.make_output(req, [])

    def poll(self) -> list[TokenOutput]:
        outputs: list[TokenOutput] = []
        now = time.monotonic()
        for free_at, req in [q for q in self.quarantine if q[0] <= now]:
            self.quarantine.remove((free_at, req))
            self.scheduler.cache.release_req(req)
        for key, outcome in self.watcher.done():
            req = self.transferring.pop(key)
            if key in self.abandoned:
                self.abandoned.discard(key)
                self._release_after(outcome, req)
            elif outcome.state == "done":
                self.arrived.append((req, outcome))
            else:
                self._release_after(outcome, req)
                req.abort(f"prefill failed: {outcome.message or outcome.state}", retryable=True)
                outputs.append(self.scheduler.make_output(req, []))
        for req, outcome in [a for a in self.arrived if _grammar_ready(a[0])]:
            self.arrived.remove((req, outcome))
            outputs += self._join(req, outcome.result)
        while self.prealloc and self._preallocate(self.prealloc[0]):
            req = self.prealloc.pop(0)
            assert req.bootstrap is not None
            slots = self.scheduler.runner.req_to_token.read(
                req.req_pool_idx, len(req.origin_input_ids)
            )
            self.transferring[req.rid] = req
            self.watcher.claim(req.rid, req.bootstrap, slots.tolist())
        return outputs

    def _join(self, req: Req, result: dict[str, Any]) -> list[TokenOutput]:
        """A request whose prompt KV arrived joins the running batch with the prefill's
        first token (or ends here if its grammar failed to compile)."""
        if req.grammar is not None and req.grammar.error is not None:
            self.scheduler.cache.release_req(req)
            req.abort(req.grammar.error)
            return [self.scheduler.make_output(req, [])]
        if req.input_logprobs is not None and result.get("input_logprobs") is not None:
            req.input_logprobs.fill(result["input_logprobs"], result.get("input_top_logprobs"))
        top = result.get("top_logprobs")
        top = [tuple(pair) for pair in top] if top else None
        req.cached_tokens = int(result.get("cached_tokens") or 0)
        return self.scheduler.add_prefilled(
            req, result.get("first_token"), result.get("logprob"), top
        )

    def _release_after(self, outcome: Outcome, req: Req) -> None:
        """Free the slots of a room that ended; after a failure, one timeout later."""
        if outcome.state == "failed":
            self.quarantine.append((time.monotonic() + self.timeout_s, req))
        else:
            self.scheduler.cache.release_req(req)

    def _preallocate(self, req: Req) -> bool:
        """A row and slots for the whole prompt, if they fit beside the running requests'
        reserved growth; nothing is taken otherwise."""
        sched, kv = self.scheduler, self.scheduler.kv
        prompt_len = len(req.origin_input_ids)
        reserved = sum(sched.reserve(r) for r in sched.running)
        if kv.available_tokens() - reserved < prompt_len + kv.page_size:
            return False
        if not kv.admit(req):
            return False
        if kv.grow(req, prompt_len) is None:
            sched.cache.release_req(req)
            return False
        return True
