"""The scheduler subprocess: receive -> schedule -> run batch -> send tokens, forever.

Under tensor parallelism there is one such process per rank: each holds its part of the
model and its own KV pool, and all run the same schedule on the messages rank 0 receives
and broadcasts (:class:`~kvflow.runtime.server.scheduler_io.SchedulerIO`); only rank 0
sends results.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvflow.runtime.disagg.roles import ROLES, make_role
from kvflow.runtime.distributed.lockstep import Lockstep, TPLockstep
from kvflow.runtime.model_runner import ModelRunner
from kvflow.runtime.models import resolve_model_path
from kvflow.runtime.scheduler import ReqFactory, Scheduler, SchedulerPort
from kvflow.runtime.server.args import ServerArgs
from kvflow.runtime.server.ipc import IpcPaths
from kvflow.runtime.server.lora_loads import AdapterLoads, LoraLoadReady
from kvflow.runtime.server.parallel import RankPlace
from kvflow.runtime.server.scheduler_io import SchedulerIO
from kvflow.runtime.tokenizer import load_decoder, load_tokenizer, tokenizer_folder
from kvflow.runtime.wire import FinishReason, TokenOutput
from kvflow.runtime.wire.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    GenerateRequest,
    SchedulerStats,
    StreamStart,
    TokenBatch,
)

__all__ = ["run_scheduler_process"]
logger = logging.getLogger("kvflow.scheduler")
_IDLE_POLL_MS = 200
_STATS_INTERVAL_S = 0.25
_ROLE_POLL_MS = 2  # prefill/decode: requests wait on the peer; look again soon


class Watchdog(threading.Thread):
    """Logs stacks when a busy loop makes no progress; kills the process after a limit."""

    def __init__(self, timeout: float) -> None:
        super().__init__(daemon=True, name="scheduler-watchdog")
        self.timeout = timeout
        self.last_progress = time.monotonic()
        self.busy = False
        self._warned = False

    def tick(self, busy: bool) -> None:
        self.last_progress, self.busy, self._warned = time.monotonic(), busy, False

    def run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            stalled = time.monotonic() - self.last_progress
            if not self.busy:
                continue
            if stalled > self.timeout / 2 and not self._warned:
                logger.error("scheduler loop made no progress for %.0f s; stacks follow", stalled)
                faulthandler.dump_traceback(file=sys.stderr)
                self._warned = True
            if stalled > self.timeout:
                logger.critical("scheduler loop stuck for %.0f s: exiting", stalled)
                os._exit(3)


class SchedulerLoop:
    def __init__(self, args: ServerArgs, paths: IpcPaths, place: RankPlace | None = None) -> None:
        self.args = args
        place = place or RankPlace()
        role_cls = ROLES.get(args.role)
        if args.kv_transfer is not None:  # before any Mooncake engine starts (the L3 store's)
            args.kv_transfer.require_env()
        engine = place.engine(role_cls.engine_config(args.engine))
        tp = place.join(engine)
        lockstep = None if tp is None else TPLockstep(tp)
        self.lockstep = lockstep or Lockstep()
        self.place = place
        self.io = SchedulerIO(paths.scheduler_inbox(place.dp_rank), paths, tp, lockstep)
        # Stop strings are matched on text, so the scheduler decodes the requests that have them.
        self.tokenizer_folder = tokenizer_folder(
            engine.tokenizer_path,
            engine.skip_tokenizer_init,
            resolve_model_path(engine.model_path, engine.load_format),
        )
        # NOTE: stop strings need only decode: the ``tokenizers`` decoder (0.1 s) where it
        # decodes as transformers does; transformers' tokenizer (its import: 2-5 s on 2
        # cores, all start-up time) loads for the first constrained request only. Where
        # transformers is the decoder, it loads on a thread while the model loads (torch's
        # copies and packing release the GIL).
        folder = self.tokenizer_folder
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load") as pool:
            decoder_load = pool.submit(lambda: None if folder is None else load_decoder(folder))
            self.runner = ModelRunner(engine, tp)
            decoder = decoder_load.result()
        self.scheduler = Scheduler(
            engine,
            self.runner,
            park_finished=role_cls.parks_finished,
            lockstep=lockstep,
            # a rank whose step fails ends the server: its group can no longer agree
            isolate_failures=tp is None,
        )
        self.role = make_role(
            args.role, SchedulerPort(self.scheduler), args.kv_transfer, self.io.wake
        )
        self.reqs = ReqFactory(
            args.engine,
            self.runner.model_config,
            decoder,
            self.runner.device,
            self.runner.pooling,
            self.runner.lora,
            grammar_tokenizer=None if folder is None else functools.partial(load_tokenizer, folder),
        )
        self.watchdog = Watchdog(args.watchdog_timeout)
        self._last_stats = 0.0
        self.lora_loads = (
            None
            if self.runner.lora is None
            else AdapterLoads(self.runner.lora, self.io.wake, args.lora_read_timeout)
        )

    def ready_info(self) -> dict[str, Any]:
        mc = self.runner.model_config
        return {
            "context_len": self.runner.context_len,
            "vocab_size": mc.vocab_size,
            "eos_token_ids": list(mc.eos_token_ids),
            "max_total_tokens": self.runner.allocator.size,
            "page_size": self.runner.page_size,
            "num_pages": self.runner.allocator.num_pages,
            "model_path": str(self.runner.model_path),
            "tokenizer_path": None if self.tokenizer_folder is None else str(self.tokenizer_folder),
            "device": self.runner.device,
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(self.runner.kv_dtype).removeprefix("torch."),
            "role": self.args.role,
            "tp_size": self.runner.config.tp_size,
            "is_embedding": self.runner.pooling is not None,
            "pooling": None if self.runner.pooling is None else self.runner.pooling.value,
            **self.role.info(),
        }

    def _handle(self, message: Any) -> list[TokenOutput]:
        if isinstance(message, GenerateRequest):
            return self._add(message)
        elif isinstance(message, AbortRequest):
            out = self.scheduler.abort_request(message.rid, message.message) or self.role.abort(
                message.rid, message.message
            )
            return [out] if out else []
        elif isinstance(message, ControlRequest):
            reply = self._control(message)
            if reply is not None:  # (None: a load reading its files, answered once read)
                self.io.send_tokenizer(reply)
        elif isinstance(message, LoraLoadReady):
            self.io.send_tokenizer(self._finish_load(message.request_id, message.expired))
        return []

    def _add(self, message: GenerateRequest) -> list[TokenOutput]:
        """Queue a request; one that cannot be built or queued ends with an abort (the
        detokenizer hears of it first, so its stream opens and closes in order)."""
        rid = message.request_id
        self.io.send_detokenizer(
            StreamStart(
                rid,
                message.input_ids,
                message.sampling.stop,
                message.sampling.skip_special_tokens,
            )
        )
        try:
            if message.probe:  # the model itself, past the role: no room, never transferred
                self.scheduler.add_request(self.reqs.make(message))
            else:
                self.role.add(self.reqs.make(self.role.prepare(message)))
        except Exception as err:  # isolated: this request fails, the loop goes on
            logger.exception("request %s refused", rid)
            self.role.refused(message, str(err))
            return [
                TokenOutput(
                    rid,
                    [],
                    FinishReason("abort", message=f"request refused: {err}"),
                    len(message.input_ids),
                    0,
                    0,
                )
            ]
        return []

    def _control(self, message: ControlRequest) -> ControlReply | None:
        if message.kind == "flush_cache":
            return ControlReply(message.request_id, self.scheduler.flush_cache())
        if message.kind == "get_stats":
            return ControlReply(message.request_id, True, {"stats": self.stats()})
        if message.kind in ("load_lora_adapter", "unload_lora_adapter"):
            try:
                self._lora_control(message)
            except ValueError as err:
                return ControlReply(message.request_id, False, {"error": str(err)})
            return (
                None
                if message.kind == "load_lora_adapter"
                else ControlReply(message.request_id, True)
            )
        return ControlReply(
            message.request_id, False, {"error": f"unknown control {message.kind!r}"}
        )

    def _lora_control(self, message: ControlRequest) -> None:
        """Start loading an adapter (its files are read off the loop: :mod:`lora_loads`)
        or unload one; an unload is refused while requests on the adapter are in flight
        (ValueError says how many)."""
        if self.lora_loads is None:
            raise ValueError("LoRA adapters are not enabled on this server (--enable-lora)")
        name = str(message.payload["lora_name"])
        if message.kind == "load_lora_adapter":
            self.lora_loads.start(message.request_id, name, str(message.payload["lora_path"]))
            return
        in_flight = self.scheduler.requests_on_adapter(name)
        if in_flight:
            raise ValueError(
                f"LoRA adapter {name!r} has {in_flight} requests in flight; unload it once "
                "they finish"
            )
        self.lora_loads.manager.unload(name)

    def _finish_load(self, request_id: str, expired: bool) -> ControlReply:
        """Register a read adapter, on every rank or none: a rank whose read failed (or,
        ``expired``, rank 0's did not end in time) fails the load on all of them, else the
        ranks would run different models."""
        assert self.lora_loads is not None
        read = self.lora_loads.finish(request_id, expired)
        problems = self.lockstep.gather(read if isinstance(read, str) else None)
        problem = next((p for p in problems if p), None)
        if problem is None and not isinstance(read, str):
            try:
                self.lora_loads.manager.add(read)
            except ValueError as err:  # (the name was checked when the load started)
                problem = str(err)
        if problem is not None:
            return ControlReply(request_id, False, {"error": problem})
        return ControlReply(request_id, True)

    def stats(self) -> SchedulerStats:
        sched, alloc = self.scheduler, self.runner.allocator
        cached = sched.cache.total_size()
        used = alloc.size - alloc.available_size()
        rows = self.runner.req_to_token
        role = self.role.stats()
        return SchedulerStats(
            num_running_reqs=len(sched.running) + (1 if sched.chunked else 0),
            num_queue_reqs=len(sched.waiting),
            kv_total_tokens=alloc.size,
            kv_used_tokens=used,
            kv_request_tokens=used - cached,
            cached_tokens=cached,
            evictable_tokens=sched.cache.evictable_size(),
            generated_tokens=sched.generated_tokens,
            free_request_rows=rows.available_size(),
            total_request_rows=rows.size,
            forward_steps=sched.forward_steps,
            num_retractions=sched.num_retractions,
            num_prefill_inflight_queue_reqs=role.prefill_inflight,
            num_decode_prealloc_queue_reqs=role.decode_prealloc,
            num_decode_transfer_queue_reqs=role.decode_transfer,
            kv_transfers=role.transfers.writes,
            kv_transfer_failures=role.transfers.failures,
            kv_transfer_retries=role.transfers.retries,
            kv_transfer_bytes=role.transfers.nbytes,
            kv_transfer_seconds=role.transfers.seconds,
            recent_kv_transfers=tuple(tuple(t) for t in role.transfers.recent),
            hicache=sched.cache.tier_stats(sched.kv.hit_tokens),
            num_grammar_queue_reqs=len(sched.grammar_wait),
            dp_rank=self.place.dp_rank,
            spec_verified_reqs=sched.spec.verified_reqs if sched.spec else 0,
            spec_emitted_tokens=sched.spec.emitted_tokens if sched.spec else 0,
            spec_draft_kv_tokens=sched.spec.drafter.held_tokens() if sched.spec else 0,
        )

    def _publish_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.io.leader and (force or now - self._last_stats >= _STATS_INTERVAL_S):
            self.io.send_tokenizer(self.stats())
            self._last_stats = now

    def run_forever(self) -> None:
        self.watchdog.start()
        while True:
            self.run_once()

    def run_once(self) -> None:
        """One iteration: wait for messages (not while there is work; the role's
        ``wake`` ends the wait), handle them, poll the role, step the scheduler."""
        busy = self.scheduler.has_work() or self.role.busy()
        wait_ms = 0 if self.scheduler.has_work() else (_ROLE_POLL_MS if busy else _IDLE_POLL_MS)
        # rank 0 adds the adapter loads whose files are read (each read wakes the wait)
        loads = self.lora_loads
        messages = self.io.receive(wait_ms, loads.ready() if loads and self.io.leader else [])
        outputs: list[TokenOutput] = []
        for message in messages:  # aborts of running requests end here too: the role sees them
            outputs += self.role.observe(self._handle(message))
        outputs += self.role.poll()
        if outputs and self.scheduler.has_work():
            # NOTE: sent before the step: a PD decode's request that joined the batch just
            # now carries the prefill's first token, which would otherwise wait a whole step
            self._send(outputs)
            outputs = []
        if self.scheduler.has_work():
            outputs += self.role.observe(self.scheduler.step())
        self.watchdog.tick(self.scheduler.has_work())
        self._send(outputs)
        self._publish_stats(force=bool(messages) and not self.scheduler.has_work())

    def _send(self, outputs: list[TokenOutput]) -> None:
        if outputs:
            self.io.send_detokenizer(TokenBatch(outputs))


def run_scheduler_process(args: ServerArgs, paths: IpcPaths, place: RankPlace, ready: Any) -> None:
    """Entry point of the subprocess; reports ``("ready", info)`` or ``("error", text)`` on ``ready``."""
    name = "scheduler" + (f" dp{place.dp_rank}" if args.engine.dp_size > 1 else "")
    name += f" tp{place.tp_rank}" if args.engine.tp_size > 1 else ""
    logging.basicConfig(
        level=args.log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(message)s"
    )
    faulthandler.enable()
    try:
        loop = SchedulerLoop(args, paths, place)
    except Exception as err:  # reported to the parent, which exits with the message
        logger.exception("scheduler failed to start")
        ready.send(("error", f"{type(err).__name__}: {err}"))
        return
    # the first group's rank 0 speaks for the server (every group loads the same model)
    first = loop.io.leader and place.dp_rank == 0
    ready.send(("ready", loop.ready_info() if first else {}))
    try:
        loop.run_forever()
    except Exception:  # only without isolation: a tensor-parallel rank's failed step
        logger.critical("a step failed on this rank; its group cannot go on: exiting")
        raise
