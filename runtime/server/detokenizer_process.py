"""The detokenizer subprocess: token ids in, text deltas out (stop strings trimmed)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import zmq

from kvflow.runtime.detokenizer import TextStream
from kvflow.runtime.server.ipc import IpcPaths, Puller, Pusher
from kvflow.runtime.tokenizer import load_decoder
from kvflow.runtime.wire.messages import StreamStart, TextBatch, TextOutput, TokenBatch

__all__ = ["DetokenizerState", "run_detokenizer_process"]
logger = logging.getLogger("kvflow.detokenizer")


class DetokenizerState:
    """One :class:`TextStream` per live request, created by its :class:`StreamStart`."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.streams: dict[str, TextStream] = {}

    def start(self, message: StreamStart) -> None:
        if self.tokenizer is not None:
            self.streams[message.rid] = TextStream(
                self.tokenizer, message.prompt_ids, message.stop, message.skip_special_tokens
            )

    def process(self, batch: TokenBatch) -> TextBatch:
        outputs = []
        for out in batch.outputs:
            stream = self.streams.get(out.rid)
            delta = ""
            if stream is not None:
                if out.finish_reason is None:
                    delta = stream.push(out.new_token_ids)
                else:
                    delta = stream.finish(out.new_token_ids, out.finish_reason.matched)
            if out.finish_reason is not None:
                self.streams.pop(out.rid, None)
            outputs.append(
                TextOutput(
                    out.rid,
                    delta,
                    out.new_token_ids,
                    out.finish_reason,
                    out.prompt_tokens,
                    out.completion_tokens,
                    out.cached_tokens,
                    out.new_logprobs,
                    out.new_top_logprobs,
                    out.input_logprobs,
                    out.input_top_logprobs,
                    out.embedding,
                )
            )
        return TextBatch(outputs)


def run_detokenizer_process(model_path: str | None, paths: IpcPaths, ready: Any) -> None:
    """Entry point of the subprocess. ``model_path`` None: ids only (skip_tokenizer_init)."""
    logging.basicConfig(level="INFO", format="%(asctime)s detokenizer %(levelname)s %(message)s")
    try:
        tokenizer = load_decoder(Path(model_path)) if model_path else None
        ctx = zmq.Context()
        inbox = Puller(ctx, paths.to_detokenizer)
        to_tokenizer = Pusher(ctx, paths.to_tokenizer)
    except Exception as err:
        logger.exception("detokenizer failed to start")
        ready.send(("error", f"{type(err).__name__}: {err}"))
        return
    state = DetokenizerState(tokenizer)
    ready.send(("ready", {}))
    while True:
        message = inbox.recv()
        if isinstance(message, StreamStart):
            state.start(message)
        elif isinstance(message, TokenBatch):
            to_tokenizer.send(state.process(message))
