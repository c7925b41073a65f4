"""The TokenizerManager: validates and tokenizes requests, tracks them until they finish.

Lives in the HTTP process. Sends work to the scheduler, receives text from the
detokenizer, and hands each request's outputs to the handler awaiting them.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
import zmq.asyncio

from kvflow.runtime.grammar import GrammarError, check_grammar, grammar_spec
from kvflow.runtime.lora import parse_lora_paths
from kvflow.runtime.server.args import ServerArgs
from kvflow.runtime.server.bootstrap_fields import check_sample_rooms
from kvflow.runtime.server.dp_dispatch import DataParallelDispatcher, merge_stats
from kvflow.runtime.server.ipc import IpcPaths, Puller
from kvflow.runtime.server.metrics import RuntimeMetrics
from kvflow.runtime.tokenizer import TokenBytes, apply_chat_template
from kvflow.runtime.wire.disagg import pairing_problem
from kvflow.runtime.wire.errors import RequestError
from kvflow.runtime.wire.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    GenerateRequest,
    SchedulerStats,
    TextBatch,
    TextOutput,
)
from kvflow.runtime.wire.outputs import FinishReason

__all__ = ["INTERNAL_OWNER", "RequestHandle", "TokenizerManager"]
logger = logging.getLogger("kvflow.tokenizer_manager")
_CONTROL_TIMEOUT_S = 30.0
_QUEUE_FULL_RETRY_AFTER_S = 1
# The owner of the server's own requests (health probes, n > 1 warm-ups): no client's
# credential is ever this string, so no client can abort them.
INTERNAL_OWNER = "internal"
# NOTE: 499 (nginx's "client closed request", gRPC's CANCELLED): a 4xx, so no router
# retries a request its client cancelled.
CLIENT_ABORT_STATUS = 499
_EMBEDDING_ONLY = (
    "this server serves embeddings (started with --is-embedding): use /v1/embeddings or "
    "/encode; generation needs a server started without it"
)
_NO_EMBEDDING = (
    "this server serves generation, not embeddings: start it with --is-embedding "
    "to serve /v1/embeddings and /encode"
)


@dataclass
class _ReqState:
    owner: str  # the credential that may abort it (see http_server's credential_of)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    finished: bool = False
    streaming: bool = False
    abort_error: RequestError | None = None  # what an abort we asked for answers


class TokenizerManager:
    def __init__(
        self, args: ServerArgs, paths: IpcPaths, info: dict[str, Any], tokenizer: Any
    ) -> None:
        self.args = args
        self.info = info
        self.tokenizer = tokenizer
        self._token_bytes = None if tokenizer is None else TokenBytes(tokenizer)
        self.context_len: int = info["context_len"]
        self.vocab_size: int = info["vocab_size"]
        self.max_total_tokens: int = info["max_total_tokens"]
        self.is_embedding = args.engine.is_embedding
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        engine = args.engine
        # the scheduler groups (one without data parallelism): requests, aborts, controls
        self.to_scheduler = DataParallelDispatcher(
            self._sync_ctx, paths, engine.dp_size, engine.load_balance_method
        )
        self.inbox = Puller(self._async_ctx, paths.to_tokenizer)
        self.metrics = RuntimeMetrics(args.model_name, info["page_size"], info["num_pages"])
        self.states: dict[str, _ReqState] = {}
        self.stats: SchedulerStats | None = None  # every group's, added up
        self._group_stats: dict[int, SchedulerStats] = {}
        self._control: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        # LoRA adapters the schedulers hold, name -> path (SGLang's --lora-paths, then
        # /load_lora_adapter and /unload_lora_adapter)
        self.lora_adapters: dict[str, str] = dict(parse_lora_paths(engine.lora_paths))
        self.dead_reason: str | None = None
        self.draining = False
        self._recv_task: asyncio.Task | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    def fail_all(self, reason: str) -> None:
        """A subprocess died: every in-flight request ends with a server error."""
        self.dead_reason = reason
        for state in self.states.values():
            state.queue.put_nowait(RequestError(503, f"server unhealthy: {reason}"))
        for fut in self._control.values():
            if not fut.done():
                fut.set_exception(RequestError(503, f"server unhealthy: {reason}"))

    @property
    def num_in_flight(self) -> int:
        return len(self.states)

    async def _recv_loop(self) -> None:
        while True:
            message = await self.inbox.recv_async()
            if isinstance(message, TextBatch):
                for out in message.outputs:
                    self._deliver(out)
            elif isinstance(message, SchedulerStats):
                self._group_stats[message.dp_rank] = message
                self.stats = merge_stats(list(self._group_stats.values()))
                self.metrics.observe_stats(self.stats)
            elif isinstance(message, ControlReply):
                fut = self._control.pop(message.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(message)

    def _deliver(self, out: TextOutput) -> None:
        state = self.states.get(out.rid)
        if state is None:
            return
        now = time.monotonic()
        if out.new_token_ids:
            if state.last_token_at is None:
                self.metrics.on_first_token(now - state.created, state.streaming)
            else:
                self.metrics.on_token_gap(now - state.last_token_at, len(out.new_token_ids))
            state.last_token_at = now
        if out.finish_reason is not None:
            state.finished = True
            self.states.pop(out.rid, None)
            self.to_scheduler.finished(out.rid)
            self.metrics.on_finish(
                now - state.created,
                out.prompt_tokens,
                out.completion_tokens,
                out.cached_tokens,
                out.finish_reason.type == "abort",
            )
            if out.finish_reason.type == "abort":  # never an answer: an error status or event
                state.queue.put_nowait(_abort_error(state, out.finish_reason))
                return
        state.queue.put_nowait(out)

    # -- requests -------------------------------------------------------------------------
    def check_accepting(self) -> None:
        """Refuse new work (503, counted by reason) when unhealthy, draining or full."""
        if self.dead_reason:
            self.metrics.on_rejected("unhealthy")
            raise RequestError(503, f"server unhealthy: {self.dead_reason}")
        if self.draining:
            self.metrics.on_rejected("draining")
            raise RequestError(503, "server is shutting down")
        limit = self.args.engine.max_queued_requests
        if (
            limit is not None
            and self.num_in_flight >= self.args.engine.max_running_requests + limit
        ):
            self.metrics.on_rejected("queue_full")
            raise RequestError(
                503,
                f"too many requests: {self.num_in_flight} in flight, "
                f"queue limit {limit} reached; retry later",
                headers={"Retry-After": str(_QUEUE_FULL_RETRY_AFTER_S)},
            )

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(400, "this server skips tokenizer init: send input_ids")
        return list(self.tokenizer.encode(text))

    def chat_ids(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(400, "this server skips tokenizer init: chat needs a tokenizer")
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                400,
                "this model's tokenizer has no chat template: start the server with "
                "--chat-template FILE.jinja, or send the prompt text to /v1/completions",
            )
        try:
            return apply_chat_template(self.tokenizer, messages, **template_kwargs)
        except (ValueError, TypeError, KeyError) as err:
            raise RequestError(400, f"cannot apply the chat template: {err}") from err

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        return b"" if self._token_bytes is None else self._token_bytes.of(token_id)

    def check_token_ids(self, ids: list[int]) -> None:
        """400 unless every id is a token of this model's vocabulary."""
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(
                400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )

    def validate(self, inp: GenerateRequest) -> None:
        ids = inp.input_ids
        if not ids:
            raise RequestError(400, "the prompt is empty")
        self.check_token_ids(ids)
        if inp.embed != self.is_embedding:
            raise RequestError(400, _EMBEDDING_ONLY if self.is_embedding else _NO_EMBEDDING)
        if inp.lora_path is not None:
            self.check_adapter(inp.lora_path)
        if not inp.probe:  # the probe runs on any role (scheduler_process skips the role)
            self._check_role(inp)
        try:
            inp.sampling.validate(self.vocab_size)
        except ValueError as err:
            raise RequestError(400, str(err)) from err
        if len(ids) >= self.context_len:
            raise RequestError(
                400,
                f"the prompt has {len(ids)} tokens; this model's context "
                f"length is {self.context_len}",
            )
        total = len(ids) + inp.sampling.max_new_tokens
        if total > self.context_len:
            raise RequestError(
                400,
                f"the prompt ({len(ids)} tokens) + max_tokens "
                f"({inp.sampling.max_new_tokens}) = {total} exceeds the context "
                f"length ({self.context_len})",
            )
        if total > self.max_total_tokens:
            raise RequestError(
                400,
                f"the prompt + max_tokens ({total}) exceeds the KV cache "
                f"({self.max_total_tokens} tokens)",
            )

    def check_adapter(self, name: str) -> None:
        """400 unless LoRA adapter ``name`` is loaded."""
        if not self.args.engine.enable_lora:
            raise RequestError(
                400, f"lora_path {name!r}: this server runs without --enable-lora (no adapters)"
            )
        if name not in self.lora_adapters:
            loaded = ", ".join(sorted(self.lora_adapters)) or "none"
            raise RequestError(400, f"unknown LoRA adapter {name!r} (loaded: {loaded})")

    def adapter_of(self, model: str | None, lora_path: str | None) -> str | None:
        """The adapter a request asks for, SGLang's rules: ``lora_path`` if given; else an
        OpenAI ``model`` of the form ``base:adapter`` or an adapter's name; else none (and
        always none from ``model`` without --enable-lora: any model name is the base)."""
        if lora_path is not None or not self.args.engine.enable_lora:
            return lora_path
        if model is None or model == self.args.model_name:
            return lora_path
        if model in self.lora_adapters:
            return model
        _, sep, adapter = model.partition(":")
        return adapter if sep and adapter else None

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Every scheduler group reads the adapter; 400 with their reason if one cannot."""
        if not self.args.engine.enable_lora:
            raise RequestError(400, "LoRA adapters need --enable-lora")
        if name in self.lora_adapters:
            raise RequestError(400, f"a LoRA adapter named {name!r} is loaded already")
        reply = await self.control("load_lora_adapter", {"lora_name": name, "lora_path": path})
        if not reply.ok:
            raise RequestError(400, reply.payload.get("error", "loading the adapter failed"))
        self.lora_adapters[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        """Unload an adapter; refused (400) while requests on it are in flight. New
        requests naming it are refused from the moment this starts."""
        self.check_adapter(name)
        path = self.lora_adapters.pop(name)
        try:
            reply = await self.control("unload_lora_adapter", {"lora_name": name})
        except BaseException:
            self.lora_adapters[name] = path
            raise
        if not reply.ok:
            self.lora_adapters[name] = path
            raise RequestError(400, reply.payload.get("error", "unloading the adapter failed"))

    async def check_grammar(self, inp: GenerateRequest) -> None:
        """400 with xgrammar's message unless the request's grammar (if any) builds. A
        large schema takes a while (0.6 s for 240 KB): built on a worker thread (xgrammar
        releases the GIL), so other requests' streams go on meanwhile."""
        spec = grammar_spec(inp.sampling)
        if spec is None:
            return
        if self.tokenizer is None:
            raise RequestError(400, "structured output needs the tokenizer (skip_tokenizer_init)")
        if (error := await asyncio.to_thread(_grammar_error, spec)) is not None:
            raise RequestError(400, error)

    def _check_role(self, inp: GenerateRequest) -> None:
        problem = pairing_problem(self.info.get("role", "unified"), inp.bootstrap)
        trust = self.args.pair_trust
        if problem is None and trust is not None and inp.bootstrap is not None:
            problem = trust.problem(inp.bootstrap, inp.bootstrap.token)  # before any contact
        if problem:
            raise RequestError(400, problem)

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(self.context_len - prompt_len, 0)

    def _submit(self, request: GenerateRequest, owner: str, group: int | None = None) -> _ReqState:
        """Track and send a request (to data-parallel ``group``, default: the balancer's)."""
        if request.request_id in self.states:  # checked in generate; never replace a state
            raise RequestError(400, f"a request with rid {request.rid!r} is already in flight")
        state = _ReqState(owner, streaming=request.stream)
        self.states[request.request_id] = state
        if group is None:
            self.to_scheduler.send(request)
        else:
            self.to_scheduler.send(request, group)
        return state

    async def generate(self, inputs: list[GenerateRequest], owner: str) -> list[RequestHandle]:
        """Start every prompt (``n`` samples each); one output stream per sample, in order.
        ``owner`` is the credential that may abort them (:meth:`abort_owned`)."""
        self.check_accepting()
        for inp in inputs:
            self.validate(inp)
            await self.check_grammar(inp)
            if inp.rid is not None and (inp.sampling.n > 1 or len(inputs) > 1):
                raise RequestError(400, "rid can only name a single prompt with n = 1")
            if inp.rid is not None and inp.rid in self.states:
                raise RequestError(400, f"a request with rid {inp.rid!r} is already in flight")
        check_sample_rooms([(inp.bootstrap, inp.sampling.n) for inp in inputs])
        streams = []
        for inp in inputs:
            samples = inp.sampling.expand_n()
            # the samples of a prompt share a group: they hit its warm-up's cached prefix
            group = self.to_scheduler.pick() if len(samples) > 1 else None
            # PD: each sample has its own room, and a prompt-only warm-up would have none.
            if len(samples) > 1 and inp.bootstrap is None:
                # Prefill the shared prompt once; the samples then hit the prefix cache.
                warm = GenerateRequest(
                    input_ids=inp.input_ids,
                    sampling=inp.sampling.prefill_only(),
                    extra_key=inp.extra_key,
                    lora_path=inp.lora_path,
                )
                warm_handle = self._start(warm, INTERNAL_OWNER, group)
                try:
                    async for _ in warm_handle:
                        pass
                finally:
                    warm_handle.cancel()
            for index, sampling in enumerate(samples):
                bootstrap = inp.bootstrap.sample(index) if inp.bootstrap is not None else None
                sample = replace(inp, sampling=sampling, bootstrap=bootstrap)
                streams.append(self._start(sample, owner, group))
        return streams

    def _start(self, inp: GenerateRequest, owner: str, group: int | None = None) -> RequestHandle:
        request = replace(inp, rid=inp.rid or f"{uuid.uuid4().hex[:12]}-{next(self._ids)}")
        return RequestHandle(self, request.request_id, self._submit(request, owner, group))

    def abort(self, rid: str, message: str = "aborted by the client") -> None:
        self.to_scheduler.send(AbortRequest(rid, message))

    def abort_owned(self, rid: str, owner: str) -> bool:
        """``/abort_request``: abort ``rid`` if it is in flight and ``owner`` started it;
        False otherwise (the caller cannot tell a rid it does not own from none). The
        request then answers 499."""
        state = self.states.get(rid)
        if state is None or state.finished or not hmac.compare_digest(state.owner, owner):
            return False
        message = "aborted by /abort_request"
        state.abort_error = RequestError(CLIENT_ABORT_STATUS, f"the request was {message}")
        self.abort(rid, message)
        return True

    def abort_all(self, message: str) -> None:
        """Abort everything in flight (shutdown): each request answers 503 ``message``."""
        for rid, state in list(self.states.items()):
            state.abort_error = RequestError(503, message)
            self.abort(rid, message)

    async def control(self, kind: str, payload: dict[str, Any] | None = None) -> ControlReply:
        """Ask every scheduler group; ``ok`` when all are, their stats added up."""
        if self.dead_reason:
            raise RequestError(503, f"server unhealthy: {self.dead_reason}")
        base = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        ids = [f"{base}-{group}" for group in range(self.to_scheduler.size)]
        futures = []
        for group, request_id in enumerate(ids):
            fut: asyncio.Future = loop.create_future()
            self._control[request_id] = fut
            futures.append(fut)
            self.to_scheduler.send_to(group, ControlRequest(request_id, kind, payload or {}))
        try:
            replies = await asyncio.wait_for(asyncio.gather(*futures), _CONTROL_TIMEOUT_S)
        except TimeoutError as err:
            raise RequestError(503, f"the scheduler did not answer {kind} in time") from err
        finally:
            for request_id in ids:
                self._control.pop(request_id, None)
        payload = dict(replies[0].payload)
        if "stats" in payload:
            payload["stats_per_group"] = [r.payload["stats"] for r in replies]
            payload["stats"] = merge_stats(payload["stats_per_group"])
        return ControlReply(base, all(r.ok for r in replies), payload)


def _abort_error(state: _ReqState, reason: FinishReason) -> RequestError:
    """What an aborted request answers: the error of an abort we asked for (the client's
    499, shutdown's 503), else the scheduler's reason: 503 when another worker may serve
    it (a failed prefill/decode peer, before any token), 500 for any other failure."""
    if state.abort_error is not None:
        return state.abort_error
    if reason.retryable:
        return RequestError(503, reason.message)
    return RequestError(500, f"the server aborted the request: {reason.message}")


@functools.lru_cache(maxsize=1024)
def _grammar_error(spec) -> str | None:
    """Why ``spec`` cannot build, or None (cached: clients repeat their schemas)."""
    try:
        check_grammar(spec)
    except GrammarError as err:
        return str(err)
    return None


class RequestHandle:
    """One running sample: iterate it for its outputs; :meth:`cancel` aborts it if unfinished."""

    def __init__(self, manager: TokenizerManager, rid: str, state: _ReqState) -> None:
        self.manager = manager
        self.rid = rid
        self._state = state

    @property
    def finished(self) -> bool:
        return self._state.finished

    async def __aiter__(self) -> AsyncIterator[TextOutput]:
        while True:
            item = await self._state.queue.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def cancel(self, message: str = "the client went away") -> None:
        if not self._state.finished and self.rid in self.manager.states:
            self.manager.abort(self.rid, message)
