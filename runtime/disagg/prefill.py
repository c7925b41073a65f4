"""The prefill role: run each request's prompt (and first token), then send its KV to the
decode that claimed the request's bootstrap room, and free it.

Queue of one request::

    arrive (room queued) -> scheduler prefills, samples the first token -> parked
    -> room claimed by a decode -> KV written into the decode's slots (a sender thread)
    -> room done (first token, logprobs) -> KV released into the prefix cache

A parked request nobody claims within the timeout, a cancelled room, or a failed write
ends the room as failed; the KV is released in every case.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvflow.runtime.disagg.bootstrap import BootstrapServer
from kvflow.runtime.disagg.layout import layout_of
from kvflow.runtime.disagg.plan import transfer_plan
from kvflow.runtime.disagg.roles import Role, RoleStats
from kvflow.runtime.disagg.rooms import Claim, Rooms
from kvflow.runtime.disagg.transfer_log import TransferLog, timed_write
from kvflow.runtime.disagg.transport import KVTransport
from kvflow.runtime.scheduler import Req, Scheduler
from kvflow.runtime.wire import TokenOutput

__all__ = ["PrefillRole"]
logger = logging.getLogger("kvflow.prefill")


class PrefillRole(Role):
    def __init__(
        self,
        scheduler: Scheduler,
        *,
        transport: KVTransport,
        bootstrap_host: str,
        bootstrap_port: int,
        timeout_s: float,
    ) -> None:
        super().__init__(scheduler)
        runner = scheduler.runner
        scheduler.park_finished = True
        self.transport = transport
        self.layout = layout_of(runner.kv_pool, runner.model_config, runner.page_size)
        for region in self.layout.regions():
            transport.register(region.ptr, region.nbytes)
        self.rooms = Rooms(timeout_s)
        self.server = BootstrapServer(bootstrap_host, bootstrap_port, self.layout, self.rooms)
        self.server.start()
        self._sender = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvflow-kv-send")
        self._sending: dict[int, Future] = {}  # id(req) -> the write in flight
        self._room_of: dict[str, int] = {}  # rid -> room, while the scheduler has the request
        self.transfers = TransferLog()

    def info(self) -> dict[str, Any]:
        return {"bootstrap_port": self.server.port, "kv_session": self.transport.session_id}

    def stats(self) -> RoleStats:
        return RoleStats(
            prefill_inflight=len(self.scheduler.parked), transfers=self.transfers.totals()
        )

    def add(self, req: Req) -> None:
        if req.bootstrap is None:
            raise ValueError(
                "this server runs the prefill role: requests come through a PD router with "
                "bootstrap_host, bootstrap_port and bootstrap_room"
            )
        problem = self.rooms.arrive(req.bootstrap.room)
        if problem:
            raise ValueError(problem)
        self.scheduler.add_request(req)
        self._room_of[req.rid] = req.bootstrap.room

    def observe(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            if out.finish_reason is None:
                continue
            room = self._room_of.pop(out.rid, None)
            if room is not None and out.finish_reason.type == "abort":
                self.rooms.finish(
                    room, "failed", f"the prefill aborted: {out.finish_reason.message}"
                )

    def abort(self, rid: str, message: str) -> TokenOutput | None:
        for req in self.scheduler.parked:
            if req.rid == rid and id(req) not in self._sending:
                self._give_up(req, f"aborted at the prefill: {message}")
        return None  # its output (the first token) was sent already

    def busy(self) -> bool:
        return bool(self.scheduler.parked)

    def poll(self) -> list[TokenOutput]:
        self.rooms.expire()
        for req in list(self.scheduler.parked):
            if id(req) in self._sending:
                self._collect(req)
                continue
            assert req.bootstrap is not None
            self.rooms.ready(req.bootstrap.room)
            claim = self.rooms.take_claim(req.bootstrap.room)
            if isinstance(claim, Claim):
                self._send(req, claim)
            elif claim is not None:
                self._give_up(req, claim)
        return []

    def _send(self, req: Req, claim: Claim) -> None:
        assert req.bootstrap is not None
        prompt_len = len(req.origin_input_ids)
        peer = self.server.sessions.get(claim.session)
        if peer is None or len(claim.slots) != prompt_len:
            why = (
                f"the decode claimed {len(claim.slots)} slots for a {prompt_len}-token prompt"
                if peer is not None
                else f"decode session {claim.session} is not registered"
            )
            self._give_up(req, why)
            return
        src_slots = self.scheduler.runner.req_to_token.read(req.req_pool_idx, prompt_len)
        writes = transfer_plan(self.layout, peer, src_slots.tolist(), list(claim.slots))
        self._sending[id(req)] = self._sender.submit(
            timed_write, self.transport.write, claim.session, writes
        )

    def _collect(self, req: Req) -> None:
        future = self._sending[id(req)]
        if not future.done():
            return
        del self._sending[id(req)]
        assert req.bootstrap is not None
        error = future.exception()
        if error is not None:
            logger.warning("KV transfer for room %d failed: %s", req.bootstrap.room, error)
            self.transfers.record_failure()
            self._give_up(req, f"KV transfer failed: {error}")
            return
        self.transfers.record(future.result())
        result = {
            "first_token": req.output_ids[0] if req.output_ids else None,
            "logprob": req.output_logprobs[0] if req.output_logprobs else None,
            "top_logprobs": req.output_top_logprobs[0] if req.output_top_logprobs else None,
            "cached_tokens": req.cached_tokens,
        }
        if req.input_logprobs is not None and req.input_logprobs.complete:
            result["input_logprobs"] = req.input_logprobs.values
            result["input_top_logprobs"] = req.input_logprobs.tops
        self.scheduler.release_parked(req)
        self.rooms.finish(req.bootstrap.room, "done", result)

    def _give_up(self, req: Req, why: str) -> None:
        assert req.bootstrap is not None
        self.scheduler.release_parked(req)
        self.rooms.finish(req.bootstrap.room, "failed", why)
