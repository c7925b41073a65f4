"""CUDA graphs for decode: one graph per captured batch size, replayed with padding.

Static buffers (sized for the largest captured batch)::

    inputs [5, max_bs] int64, rows: input_ids, positions, out_cache_loc,
                                    req_pool_indices, seq_lens
    features [max_bs, width]        an EAGLE head's ``input_hidden`` (draft graphs only)
    attention metadata: backend-owned, see ``init_capture`` / ``fill_replay``
    other graph inputs (LoRA's rows grouped by adapter): owned by their ``GraphInputs``

A replay fills ``inputs`` with one stack-and-copy of the batch's rows (and one copy of
the padding rows); :meth:`CudaGraphRunner.stage` does that ahead of the replay, behind the
work already queued on the stream (the scheduler stages step N+1 while step N runs).

A batch of ``bs`` requests replays the graph of the smallest captured size ``>= bs``; the
padded rows write KV slot 0 (the reserved padding page), read one slot through table
row 0, and their outputs are dropped. The graphs bake in the addresses of the KV pool
tensors, which are allocated once at start-up and never reallocated;
:meth:`CudaGraphRunner.capture` can be called again whenever that changes.

The target captures its logits; a speculative draft captures its own decode steps
(:mod:`kvflow.runtime.speculative.draft_graphs`) into the target's graph memory: graphs
that never run at the same time share their intermediate buffers (SGLang's global graph
memory pool), while each graph's output stays its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode

__all__ = [
    "CudaGraphRunner",
    "FeatureInput",
    "GraphAttention",
    "GraphInputs",
    "capture_batch_sizes",
]
logger = logging.getLogger(__name__)

_ROWS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_bs`` (SGLang's default ladder)."""
    sizes = [bs for bs in (1, 2, 4) if bs <= max_bs] + list(range(8, max_bs + 1, 8))
    return sorted(set(sizes))


class GraphInputs(Protocol):
    """Inputs of the captured forward besides the batch rows and the attention metadata
    (a LoRA batch's rows grouped by adapter): static buffers allocated once, refilled
    before each replay, and visible to the model while a graph is captured."""

    def init_capture(self, max_bs: int) -> None: ...

    def fill_replay(self, fb: ForwardBatch, padded_bs: int) -> None:
        """Write ``fb``'s part into the static buffers, padded to ``padded_bs`` rows."""

    def capturing(self, bs: int) -> AbstractContextManager[None]:
        """The model reads the static buffers of ``bs`` rows inside this context."""
        ...


@runtime_checkable
class GraphAttention(Protocol):
    """What an attention backend adds to run inside CUDA graphs: metadata buffers at fixed
    addresses, allocated once for the largest batch and refilled before each replay."""

    def init_capture(self, max_bs: int) -> None: ...

    def fill_replay(self, fb: ForwardBatch, padded_bs: int) -> None:
        """Write ``fb``'s metadata into the static buffers, padded to ``padded_bs`` rows."""


class FeatureInput(NamedTuple):
    """``ForwardBatch.input_hidden`` as a graph input (an EAGLE head's draft steps): its
    columns and dtype. A batch whose features have another width runs eagerly."""

    width: int
    dtype: torch.dtype


class CudaGraphRunner:
    """Captures ``run_model`` (a decode batch whose attention metadata ``attn`` has
    filled -> one output row per request: the target's last-position logits, a draft's
    tokens or hidden states) once per batch size and replays it.

    ``features``: the batches carry ``input_hidden`` of that shape (a static buffer).
    ``share``: capture into that runner's memory pool, on its capture stream (the
    caching allocator reuses a pool's free blocks only for the stream that freed them),
    so that these graphs' intermediates reuse the memory of its graphs'; the two sets
    must never run concurrently (they do not: one scheduler stream runs both).
    """

    def __init__(
        self,
        run_model: Callable[[ForwardBatch], torch.Tensor],
        attn: GraphAttention,
        device: str,
        max_bs: int,
        extra_inputs: Sequence[GraphInputs] = (),
        features: FeatureInput | None = None,
        share: CudaGraphRunner | None = None,
    ) -> None:
        self.run_model = run_model
        self.attn = attn
        self.extra_inputs = tuple(extra_inputs)
        self.sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.inputs = torch.zeros((len(_ROWS), self.max_bs), dtype=torch.int64, device=device)
        self.inputs[_ROWS.index("seq_lens")] = 1
        # What padding rows hold: one token at position 0 in table row 0, writing the
        # padding slot 0.
        self.padding = self.inputs.clone()
        # NOTE: padding rows keep whatever features the buffer held (zeros at first, then
        # earlier batches' finite values): their outputs are dropped.
        self.features: torch.Tensor | None = None
        if features is not None:
            self.features = torch.zeros(
                (self.max_bs, features.width), dtype=features.dtype, device=device
            )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.device = device
        self.pool: Any = share.pool if share is not None else None
        # the side stream captures run on (made at the first capture)
        self.stream: torch.cuda.Stream | None = share.stream if share is not None else None
        self.replays = 0  # graphs launched since start (tests check the graphs ran)
        self._staged: ForwardBatch | None = None  # the batch ``inputs`` hold, if staged

    def can_run(self, fb: ForwardBatch) -> bool:
        if not fb.is_decode or fb.batch_size > self.max_bs:
            return False
        if self.features is None or fb.input_hidden is None:
            return self.features is None and fb.input_hidden is None
        return fb.input_hidden.shape[-1] == self.features.shape[-1]

    def _static_batch(self, bs: int) -> ForwardBatch:
        rows = dict(zip(_ROWS, self.inputs[:, :bs], strict=True))
        hidden = None if self.features is None else self.features[:bs]
        return ForwardBatch(
            mode=ForwardMode.DECODE, seq_lens_cpu=[1] * bs, input_hidden=hidden, **rows
        )

    @torch.inference_mode()
    def capture(self) -> None:
        attn = self.attn
        attn.init_capture(self.max_bs)
        for part in self.extra_inputs:
            part.init_capture(self.max_bs)
        self.graphs.clear()
        self.outputs.clear()
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        stream = self.stream
        for bs in reversed(self.sizes):  # largest first: later graphs reuse its pool memory
            fb = self._static_batch(bs)
            attn.fill_replay(fb, bs)
            for part in self.extra_inputs:
                part.fill_replay(fb, bs)
            # The warm-up runs on the side stream: it must see the inputs and the attention
            # metadata that the current stream has just written (without the wait it raced
            # them, reading whatever the reused memory held: an engine built after another
            # in one process looked up stale token ids, a device-side index assert).
            stream.wait_stream(torch.cuda.current_stream())
            with ExitStack() as reading:
                for part in self.extra_inputs:
                    reading.enter_context(part.capturing(bs))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm up (Triton autotuning, lazy init) outside capture
                        self.run_model(fb)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[bs] = self.run_model(fb)
            self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def _padded(self, bs: int) -> int:
        return next(size for size in self.sizes if size >= bs)

    def stage(self, fb: ForwardBatch) -> None:
        """Copy the batch into the static inputs (stream-ordered: the graph replayed before
        has read them by the time the copy runs)."""
        bs = fb.batch_size
        padded = self._padded(bs)
        self.inputs[:, :bs].copy_(torch.stack([getattr(fb, name) for name in _ROWS]))
        if padded > bs:
            self.inputs[:, bs:padded].copy_(self.padding[:, bs:padded])
        if self.features is not None:
            assert fb.input_hidden is not None, "can_run() checks the batch's features"
            self.features[:bs].copy_(fb.input_hidden)
        self.attn.fill_replay(fb, padded)
        for part in self.extra_inputs:
            part.fill_replay(fb, padded)
        self._staged = fb

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """The batch's output rows: a view of the graph's output, which the next replay of
        that size overwrites."""
        if self._staged is not fb:
            self.stage(fb)
        self._staged = None
        padded = self._padded(fb.batch_size)
        self.graphs[padded].replay()
        self.replays += 1
        return self.outputs[padded][: fb.batch_size]
