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
released in every case. Under EAGLE / EAGLE3 every write carries the target's features of
the same slots (what the decode's head reads of the prompt). Under tensor parallelism each
rank sends its KV-head shard (see :class:`PrefillRole` and
:mod:`kvflow.runtime.disagg.ranks`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from kvflow.runtime.config import EngineConfig
from kvflow.runtime.disagg.bootstrap import BootstrapServer
from kvflow.runtime.disagg.layout import KVLayout
from kvflow.runtime.disagg.plan import SlotPlan, slot_plan
from kvflow.runtime.disagg.ranks import Endpoint
from kvflow.runtime.disagg.roles import KVRole, RoleStats
from kvflow.runtime.disagg.rooms import Claim, Rooms
from kvflow.runtime.disagg.transfer_log import TimedWrite, TransferLog, timed_write
from kvflow.runtime.disagg.transport import KVTransferOptions, TransferError
from kvflow.runtime.scheduler import Req, SchedulerPort
from kvflow.runtime.wire import GenerateRequest, TokenOutput
from kvflow.runtime.wire.disagg import PrefillResult, prompt_hash

__all__ = ["PrefillRole"]
logger = logging.getLogger("kvflow.prefill")


class PrefillRole(KVRole):
    """Owns the inflight queue (SGLang's name): prefilled requests whose KV waits for its
    decode's claim or is on its way; the scheduler parks them (their KV locked) for it.

    Under tensor parallelism every rank runs this role over its own KV-head shard, with its
    own transport, and writes into the decode rank of its number. Rank 0 alone serves the
    bootstrap routes and keeps the rooms: it decides when a room's writes start (or why it
    fails) and shares the decision (``Lockstep.share``); a room is done once every rank's
    writes ended well, failed if one rank's failed, decided alike on every rank in the same
    step (so every rank releases the request's KV together).
    """

    name = "prefill"
    parks_finished = True

    @classmethod
    def engine_config(cls, config: EngineConfig) -> EngineConfig:
        """Under EAGLE / EAGLE3 the target keeps its head's features (they go out with the
        KV, see :mod:`kvflow.runtime.disagg.layout`) and drafts nothing: its decode does."""
        if config.speculative_algorithm is None:
            return config
        return replace(config, speculative_features_only=True)

    def __init__(
        self,
        port: SchedulerPort,
        transfer: KVTransferOptions,
        wake: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(port, transfer, wake)
        transport = self.transport
        layouts = self.lockstep.gather(self.layout)  # rank 0 checks each decode rank's
        self.rooms: Rooms | None = None  # rank 0's
        self.server: BootstrapServer | None = None
        if self.lockstep.rank == 0:
            self.rooms = Rooms(transfer.bootstrap_timeout_s)
            self.server = BootstrapServer(
                transfer.bootstrap_host,
                transfer.bootstrap_port,
                self.layout,
                self.rooms,
                key=transfer.internal_key,
                on_register=transport.add_peer,
                on_claim=self.wake,  # a parked request's KV goes out at once
                rank_layouts=layouts if len(layouts) > 1 else (),
            )
            self.server.start()
        self._peers: dict[str, dict[str, Any]] = {}  # ranks > 0: sessions told to the transport
        self.inflight: list[Req] = []
        self._sender = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvflow-kv-send")
        self._sends: dict[str, _Send] = {}  # rid -> its KV on the way (early or whole)
        self._room_of: dict[str, int] = {}  # rid -> room, while the scheduler has the request
        self.transfers = TransferLog()
        self._on_cuda = port.kv_pool.k_buffer[0].is_cuda

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"kv_session": self.transport.session_id}
        if self.server is not None:
            info["bootstrap_port"] = self.server.port
        return info

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
        room = req.bootstrap.room
        problem = self.lockstep.share(None if self.rooms is None else self.rooms.arrive(room))
        if problem:
            raise ValueError(problem)
        try:
            self.port.admit(req)
        except Exception as err:  # the room ends with the refusal: its decode stops waiting
            self._end_room(room, "failed", {}, f"the prefill refused the request: {err}")
            raise
        self._room_of[req.rid] = room

    def refused(self, message: GenerateRequest, why: str) -> None:
        """A refused request's room fails (unless another request holds it), so its
        decode hears why at once instead of after the bootstrap timeout."""
        if self.rooms is not None and message.bootstrap is not None:
            self.rooms.refuse(message.bootstrap.room, f"the prefill refused the request: {why}")

    def observe(self, outputs: list[TokenOutput]) -> list[TokenOutput]:
        """Rooms of aborted requests fail. Prompt logprobs travel to the decode with the
        room's result and the decode answers them; this half answers an empty list, so a
        router that concatenates the halves' ``input_token_logprobs`` (SGLang's) gets each
        once."""
        parked = self.port.take_parked()
        if parked:  # its room's claim may be here already: poll without waiting
            self.wake()
        self.inflight += parked
        for out in outputs:
            if out.finish_reason is None:
                continue
            room = self._room_of.pop(out.rid, None)
            if room is not None and out.finish_reason.type == "abort":
                self._sends.pop(out.rid, None)  # writes in flight end within their timeout
                self._end_room(
                    room, "failed", {}, f"the prefill aborted: {out.finish_reason.message}"
                )
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
        if self.rooms is not None:
            self.rooms.expire()
        self._decide()
        chunked = self.port.chunked
        send = None if chunked is None else self._sends.get(chunked.rid)
        if chunked is not None and send is not None:  # the chunks the prefix cache holds
            self._send_upto(chunked, send, len(chunked.prefix_indices))
        for req in self.inflight:
            send = self._sends.get(req.rid)
            if send is not None:
                self._send_upto(req, send, len(req.origin_input_ids))
        self._collect()
        return []

    def _decide(self) -> None:
        """Start the sends of claimed rooms (of parked requests, and early of the request
        being prefilled) and give up on rooms that failed, as rank 0 decides."""
        chunked = self.port.chunked
        early = None
        if chunked is not None and chunked.bootstrap is not None and chunked.rid not in self._sends:
            early = chunked
        waiting = [req for req in self.inflight if req.rid not in self._sends]
        if early is None and not waiting:
            return  # nothing to decide (so no collective: the same on every rank)
        decided = self.lockstep.share(
            None if self.rooms is None else self._decisions(early, waiting)
        )
        for req in [early] if early is not None else []:
            target = decided.get(req.rid)
            if isinstance(target, _Target):  # refused: the room failed, the request ends parked
                self._sends[req.rid] = self._open(target)
        for req in waiting:
            target = decided.get(req.rid)
            if isinstance(target, _Target):
                self._sends[req.rid] = self._open(target)
            elif target is not None:
                self._give_up(req, target)

    def _decisions(self, early: Req | None, waiting: list[Req]) -> dict[str, _Target | str]:
        """Rank 0: per request, where its KV goes, or why its room failed (absent: wait)."""
        assert self.rooms is not None
        decided: dict[str, _Target | str] = {}
        if early is not None:
            assert early.bootstrap is not None
            claim = self.rooms.start_early(early.bootstrap.room)
            if claim is not None:
                decided[early.rid] = self._target(early, claim)
        for req in waiting:
            assert req.bootstrap is not None
            self.rooms.ready(req.bootstrap.room)
            taken = self.rooms.take_claim(req.bootstrap.room)
            if taken is not None:
                decided[req.rid] = taken if isinstance(taken, str) else self._target(req, taken)
        return decided

    def _target(self, req: Req, claim: Claim) -> _Target | str:
        """Rank 0: check the decode's claim against the prompt; why not (the room failed)
        if it is wrong."""
        assert req.bootstrap is not None and self.server is not None
        ranks = self.server.sessions.get(claim.session)
        why = _claim_problem(req.origin_input_ids, claim, ranks)
        if why is not None:
            logger.warning("room %d refused: %s", req.bootstrap.room, why)
            self._end_room(req.bootstrap.room, "failed", {}, why)
            return why
        assert ranks is not None
        return _Target(claim.slots, ranks)

    def _open(self, target: _Target) -> _Send:
        """This rank's send of a room's KV: into the decode rank of its number."""
        rank = self.lockstep.rank
        mine = target.ranks[rank]
        send = _Send(target.slots, mine.session, mine.layout)
        # NOTE: rank 0's transport was told of the decode at registration; the others learn
        # of it here, and a refusal fails this rank's send (so the room, on every rank)
        if rank > 0 and self._peers.get(mine.session) != mine.peer:
            try:
                self.transport.add_peer(mine.session, mine.peer or {})
                self._peers[mine.session] = mine.peer or {}
            except TransferError as err:
                send.error = str(err)
        return send

    def _send_upto(self, req: Req, send: _Send, end: int) -> None:
        """Write prompt positions ``send.sent .. end - 1`` (their slots as the row says)."""
        begin = send.sent
        if end <= begin or send.failed():
            return
        src = self.port.prompt_slots(req, end, begin)
        write = self._sender.submit(
            _plan_and_write,
            functools.partial(self.transport.write_plan, after=self._kv_ready()),
            send.session,
            self.layout,
            send.peer,
            src,
            send.slots[begin:end],
        )
        write.add_done_callback(lambda _: self.wake())  # the room may be done: collect it
        send.writes.append(write)
        send.sent = end

    def _kv_ready(self) -> Any:
        """A CUDA event after every forward pass enqueued so far (the KV about to be sent
        was made by one of them); None on CPU, where a step ends with its KV written."""
        if not self._on_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _collect(self) -> None:
        """Parked requests whose writes ended on every rank: their rooms are done, or failed
        when any rank's write failed (the first failing rank's reason)."""
        sending = [req for req in self.inflight if req.rid in self._sends]
        if not sending:
            return
        ended_everywhere = self.lockstep.all_true([self._sends[r.rid].ended() for r in sending])
        ended = [req for req, yes in zip(sending, ended_everywhere, strict=True) if yes]
        if not ended:
            return
        errors = [self._sends[req.rid].error_of(len(req.origin_input_ids)) for req in ended]
        ok = self.lockstep.all_true([error is None for error in errors])
        reasons: dict[str, str] = {}
        if not all(ok):  # agreed on every rank: all of them gather
            mine = {req.rid: e for req, e in zip(ended, errors, strict=True) if e is not None}
            for rank, theirs in enumerate(self.lockstep.gather(mine)):
                where = f" (tensor-parallel rank {rank})" if self.lockstep.size > 1 else ""
                for rid, why in theirs.items():
                    reasons.setdefault(rid, f"{why}{where}")
        for req, good in zip(ended, ok, strict=True):
            send = self._sends.pop(req.rid)
            if good:
                self._done(req, send)
                continue
            assert req.bootstrap is not None
            logger.warning(
                "KV transfer for room %d failed: %s", req.bootstrap.room, reasons[req.rid]
            )
            self.transfers.record_failure()
            self._give_up(req, f"KV transfer failed: {reasons[req.rid]}")

    def _done(self, req: Req, send: _Send) -> None:
        """Every rank wrote the whole prompt: the room is done with the first token."""
        assert req.bootstrap is not None
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
        self._end_room(req.bootstrap.room, "done", result.to_json())

    def _give_up(self, req: Req, why: str) -> None:
        assert req.bootstrap is not None
        self._release(req)
        self._end_room(req.bootstrap.room, "failed", {}, why)

    def _end_room(self, room: int, state: str, result: dict[str, Any], why: str = "") -> None:
        """Rank 0 reports how a room ended (the other ranks keep no rooms)."""
        if self.rooms is not None:
            self.rooms.finish(room, state, result, why)

    def _release(self, req: Req) -> None:
        self.inflight.remove(req)
        self.port.release(req)


class _Target(NamedTuple):
    """Where a room's KV goes, as rank 0 decided it for every rank: the decode's slots for
    the prompt (the same on each decode rank) and each decode rank's endpoint."""

    slots: tuple[int, ...]
    ranks: tuple[Endpoint, ...]


def _claim_problem(
    prompt: list[int], claim: Claim, ranks: tuple[Endpoint, ...] | None
) -> str | None:
    """Why the prefill must not write a request's KV where a claim says; None if it may:
    the decode is registered, holds this very prompt (by its hash) and claimed one slot
    of its pool per prompt position (on every rank)."""
    if ranks is None:
        return f"decode session {claim.session} is not registered"
    if claim.prompt_hash != prompt_hash(prompt):  # a fingerprint, not a secret
        return "the decode's prompt is not this room's prompt (prompt_hash differs)"
    if len(claim.slots) != len(prompt):
        return f"the decode claimed {len(claim.slots)} slots for a {len(prompt)}-token prompt"
    num_slots = min(rank.layout.num_slots for rank in ranks)
    if any(not 0 <= slot < num_slots for slot in claim.slots):
        return f"the decode claimed slots outside its pool of {num_slots}"
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
    """A request's KV on its way from this rank to its decode rank."""

    slots: tuple[int, ...]  # the decode's slots for prompt positions 0 .. len - 1
    session: str  # the decode rank's transport session
    peer: KVLayout  # the decode rank's layout
    sent: int = 0  # prompt positions written or being written
    writes: list[Future] = field(default_factory=list)
    error: str | None = None  # refused before any write (this rank's transport)

    def ended(self) -> bool:
        return all(f.done() for f in self.writes)

    def failed(self) -> bool:
        return self.error is not None or any(
            f.done() and f.exception() is not None for f in self.writes
        )

    def error_of(self, prompt_len: int) -> str | None:
        """Why this ended send did not write the whole prompt; None if it did."""
        if self.error is not None:
            return self.error
        for future in self.writes:
            if future.exception() is not None:
                return str(future.exception())
        if self.sent != prompt_len:
            return f"{self.sent} of {prompt_len} prompt positions written"
        return None
