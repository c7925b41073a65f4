"""CUDA graphs for decode: one graph per captured batch size, replayed with padding.

Static buffers (sized for the largest captured batch)::

    inputs [5, max_bs] int64, rows: input_ids, positions, out_cache_loc,
                                    req_pool_indices, seq_lens
    attention metadata: backend-owned, see ``init_capture`` / ``fill_replay``
    other graph inputs (LoRA's rows grouped by adapter): owned by their ``GraphInputs``

A replay fills ``inputs`` with one stack-and-copy of the batch's rows (and one copy of
the padding rows); :meth:`CudaGraphRunner.stage` does that ahead of the replay, behind the
work already queued on the stream (the scheduler stages step N+1 while step N runs).

A batch of ``bs`` requests replays the graph of the smallest captured size ``>= bs``; the
padded rows write KV slot 0 (the reserved padding page), read one slot through table
row 0, and their logits are dropped. The graphs bake in the addresses of the KV pool
tensors, which are allocated once at start-up and never reallocated;
:meth:`CudaGraphRunner.capture` can be called again whenever that changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Protocol, runtime_checkable

import torch

from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode

__all__ = ["CudaGraphRunner", "GraphAttention", "GraphInputs", "capture_batch_sizes"]
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


class CudaGraphRunner:
    """Captures ``run_model`` (a decode batch whose attention metadata ``attn`` has
    filled -> last-position logits) once per batch size and replays it."""

    def __init__(
        self,
        run_model: Callable[[ForwardBatch], torch.Tensor],
        attn: GraphAttention,
        device: str,
        max_bs: int,
        extra_inputs: Sequence[GraphInputs] = (),
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool: Any = None
        self._staged: ForwardBatch | None = None  # the batch ``inputs`` hold, if staged

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.is_decode and fb.batch_size <= self.max_bs

    def _static_batch(self, bs: int) -> ForwardBatch:
        rows = dict(zip(_ROWS, self.inputs[:, :bs], strict=True))
        return ForwardBatch(mode=ForwardMode.DECODE, seq_lens_cpu=[1] * bs, **rows)

    @torch.inference_mode()
    def capture(self) -> None:
        attn = self.attn
        attn.init_capture(self.max_bs)
        for part in self.extra_inputs:
            part.init_capture(self.max_bs)
        self.graphs.clear()
        self.logits.clear()
        stream = torch.cuda.Stream()
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
                    self.logits[bs] = self.run_model(fb)
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
        self.attn.fill_replay(fb, padded)
        for part in self.extra_inputs:
            part.fill_replay(fb, padded)
        self._staged = fb

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        if self._staged is not fb:
            self.stage(fb)
        self._staged = None
        padded = self._padded(fb.batch_size)
        self.graphs[padded].replay()
        return self.logits[padded][: fb.batch_size]
