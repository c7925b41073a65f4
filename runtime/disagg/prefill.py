"""The prefill role: run each request's prompt (and first token), then send its KV to the
decode that claimed the request's bootstrap room, and free it.

Queue of one request::

    arrive (room queued) -> scheduler prefills, chunk by chunk, samples the first token
    -> parked -> room claimed by a decode -> the rest of the KV written into the decode's
    slots (sender threads) -> room done (first token, logprobs) -> KV released into the
    prefix cache

A long prompt's KV goes out as its chunks complete: once the decode has claimed the room,
each chunk's pages are written while the scheduler computes the next chunk, so the write
after the last chunk is short. Only pages the prefix cache holds (locked for the request)
are sent early: they cannot be freed under a write. A parked request nobody claims within
the timeout, a cancelled room, or a failed write ends the room as failed; the KV is
released in every case.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvflow.runtime.disagg.bootstrap import BootstrapServer
from kvflow.runtime.disagg.layout import KVLayout, layout_of
from kvflow.runtime.disagg.plan import SlotPlan, slot_plan
from kvflow.runtime.disagg.roles import Role, RoleStats
from kvflow.runtime.disagg.rooms import Claim, Rooms
from kvflow.runtime.disagg.transfer_log import TimedWrite, TransferLog, timed_write
from kvflow.runtime.disagg.transport import KVTransferOptions
from kvflow.runtime.scheduler import Req, SchedulerPort
from kvflow.runtime.wire import GenerateRequest, TokenOutput
from kvflow.runtime.wire.disagg import PrefillResult, prompt_hash

__all__ = ["PrefillRole"]
logger = logging.getLogger("kvflow.prefill")


class PrefillRole(Role):
    """Owns the inflight queue (SGLang's name): prefilled requests whose KV waits for its
    decode's claim or is on its way; the scheduler parks them (their KV locked) for it."""

    name = "prefill"
    parks_finished = True

    def __init__(self, port: SchedulerPort, transfer: KVTransferOptions) -> None:
        super().__init__(port)
        self.transport = transport = transfer.transport()
        self.layout = layout_of(port.kv_pool, port.model_config, port.page_size)
        for buffer in (*port.kv_pool.k_buffer, *port.kv_pool.v_buffer):
            transport.register_buffer(buffer)
        self.rooms = Rooms(transfer.timeout_s)
        self.server = BootstrapServer(
            transfer.bootstrap_host,
            transfer.bootstrap_port,
            self.layout,
            self.rooms,
            key=transfer.internal_key,
            on_register=transport.add_peer,
        )
        self.server.start()
        self.inflight: list[Req] = []
        self._sender = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvflow-kv-send")
        self._sends: dict[str, _Send] = {}  # rid -> its KV on the way (early or whole)
        self._room_of: dict[str, int] = {}  # rid -> room, while the scheduler has the request
        self.transfers = TransferLog()
        self._on_cuda = port.kv_pool.k_buffer[0].is_cuda

    def info(self) -> dict[str, Any]:
        return {"bootstrap_port": self.server.port, "kv_session": self.transport.session_id}

    def stats(self) -> RoleStats:
        totals = self.transfers.totals()._replace(retries=self.transport.retries)
        return RoleStats(prefill_inflight=len(self.inflight), transfers=totals)

    def prepare(self, message: GenerateRequest) -> GenerateRequest:
        """The prefill samples the first token only; the decode makes the rest."""
        if message.sampling.max_new_tokens <= 1:
            return message
        return replace(message, sampling=message.sampling.replace(max_new_tokens=1))

    def admit(self, req: Req) -> None:
        assert req.bootstrap is not None
        problem = self.rooms.arrive(req.bootstrap.room)
        if problem:
            raise ValueError(problem)
        self.port.admit(req)
        self._room_of[req.rid] = req.bootstrap.room

    def observe(self, outputs: list[TokenOutput]) -> list[TokenOutput]:
        """Rooms of aborted requests fail. Prompt logprobs travel to the decode with the
        room's result and the decode answers them; this half answers an empty list, so a
        router that concatenates the halves' ``input_token_logprobs`` (SGLang's) gets each
        once."""
        self.inflight += self.port.take_parked()
        for out in outputs:
            if out.finish_reason is None:
                continue
            room = self._room_of.pop(out.rid, None)
            if room is not None and out.finish_reason.type == "abort":
                self._sends.pop(out.rid, None)  # writes in flight end within their timeout
                why = f"the prefill aborted: {out.finish_reason.message}"
                self.rooms.finish(room, "failed", {}, why)
        return [
            replace(out, input_logprobs=[], input_top_logprobs=[])
            if out.input_logprobs is not None
            else out
            for out in outputs
        ]

    def abort(self, rid: str, message: str) -> TokenOutput | None:
        for req in list(self.inflight):
            if req.rid == rid and rid not in self._sends:
                self._give_up(req, f"aborted at the prefill: {message}")
        return None  # its output (the first token) was sent already

    def busy(self) -> bool:
        return bool(self.inflight)

    def poll(self) -> list[TokenOutput]:
        self.rooms.expire()
        chunked = self.port.chunked
        if chunked is not None and chunked.bootstrap is not None:
            self._send_early(chunked)
        for req in list(self.inflight):
            assert req.bootstrap is not None
            send = self._sends.get(req.rid)
            if send is None:
                self.rooms.ready(req.bootstrap.room)
                claim = self.rooms.take_claim(req.bootstrap.room)
                if isinstance(claim, Claim):
                    send = self._start(req, claim)
                elif claim is not None:
                    self._give_up(req, claim)
            if send is not None:
                self._send_upto(req, send, len(req.origin_input_ids))
                self._collect(req, send)
        return []

    def _send_early(self, req: Req) -> None:
        """Write the chunks of a prompt still being prefilled that the prefix cache holds."""
        assert req.bootstrap is not None
        send = self._sends.get(req.rid)
        if send is None:
            claim = self.rooms.start_early(req.bootstrap.room)
            if claim is None:
                return
            send = self._start(req, claim)
            if send is None:
                return  # refused: the room failed; the request ends when parked
        self._send_upto(req, send, len(req.prefix_indices))

    def _start(self, req: Req, claim: Claim) -> _Send | None:
        """Check the decode's claim against the prompt; None (room failed) if it is wrong."""
        assert req.bootstrap is not None
        peer = self.server.sessions.get(claim.session)
        why = _claim_problem(req.origin_input_ids, claim, peer)
        if why is not None:
            logger.warning("room %d refused: %s", req.bootstrap.room, why)
            self.rooms.finish(req.bootstrap.room, "failed", {}, why)
            return None
        assert peer is not None
        send = self._sends[req.rid] = _Send(claim, peer)
        return send

    def _send_upto(self, req: Req, send: _Send, end: int) -> None:
        """Write prompt positions ``send.sent .. end - 1`` (their slots as the row says)."""
        begin = send.sent
        if end <= begin or send.failed():
            return
        src = self.port.prompt_slots(req, end, begin)
        send.writes.append(
            self._sender.submit(
                _plan_and_write,
                functools.partial(self.transport.write_plan, after=self._kv_ready()),
                send.claim.session,
                self.layout,
                send.peer,
                src,
                send.claim.slots[begin:end],
            )
        )
        send.sent = end

    def _kv_ready(self) -> Any:
        """A CUDA event after every forward pass enqueued so far (the KV about to be sent
        was made by one of them); None on CPU, where a step ends with its KV written."""
        if not self._on_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _collect(self, req: Req, send: _Send) -> None:
        """Once every write of a parked request ended: the room is done, or failed."""
        if not all(f.done() for f in send.writes):
            return
        del self._sends[req.rid]
        assert req.bootstrap is not None
        errors: list[Any] = [f.exception() for f in send.writes if f.exception() is not None]
        if not errors and send.sent != len(req.origin_input_ids):
            errors = [f"{send.sent} of {len(req.origin_input_ids)} prompt positions written"]
        if errors:
            logger.warning("KV transfer for room %d failed: %s", req.bootstrap.room, errors[0])
            self.transfers.record_failure()
            self._give_up(req, f"KV transfer failed: {errors[0]}")
            return
        for future in send.writes:
            self.transfers.record(future.result())
        prompt = req.input_logprobs
        complete = prompt is not None and prompt.complete
        top = req.output_top_logprobs[0] if req.output_top_logprobs else None
        result = PrefillResult(
            first_token=req.output_ids[0] if req.output_ids else None,
            logprob=req.output_logprobs[0] if req.output_logprobs else None,
            top_logprobs=None if top is None else tuple(top),
            cached_tokens=req.cached_tokens,
            input_logprobs=tuple(prompt.values) if complete else None,
            input_top_logprobs=tuple(prompt.tops) if complete else None,
        )
        self._release(req)
        self.rooms.finish(req.bootstrap.room, "done", result.to_json())

    def _give_up(self, req: Req, why: str) -> None:
        assert req.bootstrap is not None
        self._release(req)
        self.rooms.finish(req.bootstrap.room, "failed", {}, why)

    def _release(self, req: Req) -> None:
        self.inflight.remove(req)
        self.port.release(req)


def _claim_problem(prompt: list[int], claim: Claim, peer: KVLayout | None) -> str | None:
    """Why the prefill must not write a request's KV where a claim says; None if it may:
    the decode is registered, holds this very prompt (by its hash) and claimed one slot
    of its pool per prompt position."""
    if peer is None:
        return f"decode session {claim.session} is not registered"
    if claim.prompt_hash != prompt_hash(prompt):  # a fingerprint, not a secret
        return "the decode's prompt is not this room's prompt (prompt_hash differs)"
    if len(claim.slots) != len(prompt):
        return f"the decode claimed {len(claim.slots)} slots for a {len(prompt)}-token prompt"
    if any(not 0 <= slot < peer.num_slots for slot in claim.slots):
        return f"the decode claimed slots outside its pool of {peer.num_slots}"
    return None


def _plan_and_write(
    write: Callable[[str, SlotPlan], None],
    session: str,
    src: KVLayout,
    dst: KVLayout,
    src_slots: list[int],
    dst_slots: tuple[int, ...],
) -> TimedWrite:
    """One write of prompt KV (on a sender thread): the plan's errors fail the room."""
    return timed_write(write, session, slot_plan(src, dst, src_slots, dst_slots))


@dataclass
class _Send:
    """A request's KV on its way to the decode that claimed its room."""

    claim: Claim
    peer: KVLayout  # the decode's layout
    sent: int = 0  # prompt positions written or being written
    writes: list[Future] = field(default_factory=list)

    def failed(self) -> bool:
        return any(f.done() and f.exception() is not None for f in self.writes)
