"""The scheduler subprocess: receive -> schedule -> run batch -> send tokens, forever."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Any

import zmq

from kvflow.runtime.disagg.roles import ROLES, make_role
from kvflow.runtime.model_runner import ModelRunner
from kvflow.runtime.scheduler import ReqFactory, Scheduler, SchedulerPort
from kvflow.runtime.server.args import ServerArgs
from kvflow.runtime.server.ipc import IpcPaths, Puller, Pusher
from kvflow.runtime.tokenizer import load_tokenizer, tokenizer_folder
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
    def __init__(self, args: ServerArgs, paths: IpcPaths) -> None:
        self.args = args
        role_cls = ROLES.get(args.role)
        if args.kv_transfer is not None:  # before any Mooncake engine starts (the L3 store's)
            args.kv_transfer.require_env()
        engine = role_cls.engine_config(args.engine)
        self.runner = ModelRunner(engine)
        self.scheduler = Scheduler(engine, self.runner, park_finished=role_cls.parks_finished)
        self.role = make_role(args.role, SchedulerPort(self.scheduler), args.kv_transfer)
        # Stop strings are matched on text, so the scheduler decodes the requests that have them.
        self.tokenizer_folder = tokenizer_folder(
            engine.tokenizer_path, engine.skip_tokenizer_init, self.runner.model_path
        )
        tokenizer = None if self.tokenizer_folder is None else load_tokenizer(self.tokenizer_folder)
        self.reqs = ReqFactory(args.engine, self.runner.model_config, tokenizer, self.runner.device)
        ctx = zmq.Context()
        self.inbox = Puller(ctx, paths.to_scheduler)
        self.to_detokenizer = Pusher(ctx, paths.to_detokenizer)
        self.to_tokenizer = Pusher(ctx, paths.to_tokenizer)
        self.watchdog = Watchdog(args.watchdog_timeout)
        self._last_stats = 0.0

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
            "role": self.args.role,
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
            self.to_tokenizer.send(self._control(message))
        return []

    def _add(self, message: GenerateRequest) -> list[TokenOutput]:
        """Queue a request; one that cannot be built or queued ends with an abort (the
        detokenizer hears of it first, so its stream opens and closes in order)."""
        rid = message.request_id
        self.to_detokenizer.send(
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

    def _control(self, message: ControlRequest) -> ControlReply:
        if message.kind == "flush_cache":
            return ControlReply(message.request_id, self.scheduler.flush_cache())
        if message.kind == "get_stats":
            return ControlReply(message.request_id, True, {"stats": self.stats()})
        return ControlReply(
            message.request_id, False, {"error": f"unknown control {message.kind!r}"}
        )

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
            kv_transfer_bytes=role.transfers.nbytes,
            kv_transfer_seconds=role.transfers.seconds,
            recent_kv_transfers=tuple(tuple(t) for t in role.transfers.recent),
            hicache=sched.cache.tier_stats(sched.kv.hit_tokens),
            num_grammar_queue_reqs=len(sched.grammar_wait),
        )

    def _publish_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_stats >= _STATS_INTERVAL_S:
            self.to_tokenizer.send(self.stats())
            self._last_stats = now

    def run_forever(self) -> None:
        self.watchdog.start()
        while True:
            busy = self.scheduler.has_work() or self.role.busy()
            wait_ms = 0 if self.scheduler.has_work() else (_ROLE_POLL_MS if busy else _IDLE_POLL_MS)
            first = self.inbox.recv(timeout_ms=wait_ms)
            messages = ([first] if first is not None else []) + self.inbox.recv_all()
            outputs: list[TokenOutput] = []
            for message in messages:  # aborts of running requests end here too: the role sees them
                outputs += self.role.observe(self._handle(message))
            outputs += self.role.poll()
            if self.scheduler.has_work():
                outputs += self.role.observe(self.scheduler.step())
            self.watchdog.tick(self.scheduler.has_work())
            if outputs:
                self.to_detokenizer.send(TokenBatch(outputs))
            self._publish_stats(force=bool(messages) and not self.scheduler.has_work())


def run_scheduler_process(args: ServerArgs, paths: IpcPaths, ready: Any) -> None:
    """Entry point of the subprocess; reports ``("ready", info)`` or ``("error", text)`` on ``ready``."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s scheduler %(levelname)s %(message)s"
    )
    faulthandler.enable()
    try:
        loop = SchedulerLoop(args, paths)
    except Exception as err:  # reported to the parent, which exits with the message
        logger.exception("scheduler failed to start")
        ready.send(("error", f"{type(err).__name__}: {err}"))
        return
    ready.send(("ready", loop.ready_info()))
    loop.run_forever()
