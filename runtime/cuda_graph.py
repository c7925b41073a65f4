"""CUDA graphs for decode: one graph per captured batch size, replayed with padding.

Static buffers (sized for the largest captured batch)::

    input_ids, positions, out_cache_loc, req_pool_indices, seq_lens : [max_bs]
    attention metadata                                               : backend-owned, see
                                                                       ``init_capture`` / ``fill_replay``

A batch of ``bs`` requests replays the graph of the smallest captured size ``>= bs``; the
padded rows read and write KV slot 0 (the reserved padding page) and their logits are
dropped. The graphs bake in the addresses of the KV pool tensors, which are allocated once
at start-up and never reallocated; :meth:`CudaGraphRunner.capture` can be called again
whenever that changes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvflow.runtime.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from kvflow.runtime.model_runner import ModelRunner

__all__ = ["CudaGraphRunner", "capture_batch_sizes"]
logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_bs`` (SGLang's default ladder)."""
    sizes = [bs for bs in (1, 2, 4) if bs <= max_bs] + list(range(8, max_bs + 1, 8))
    return sorted(set(sizes))


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, max_bs: int) -> None:
        self.runner = runner
        self.sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        device = runner.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool: Any = None

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.is_decode and fb.batch_size <= self.max_bs

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=[1] * bs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        attn = self.runner.attn
        attn.init_capture(self.max_bs)  # type: ignore[attr-defined]
        self.graphs.clear()
        self.logits.clear()
        stream = torch.cuda.Stream()
        for bs in reversed(self.sizes):  # largest first: later graphs reuse its pool memory
            fb = self._static_batch(bs)
            attn.fill_replay(fb, bs)  # type: ignore[attr-defined]
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up (Triton autotuning, lazy init) outside capture
                    self.runner.run_model(fb)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.logits[bs] = self.runner.run_model(fb)
            self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        bs = fb.batch_size
        padded = next(size for size in self.sizes if size >= bs)
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        if padded > bs:
            # Padding rows: one token at position 0, writing and reading the padding slot 0.
            for buf in (self.input_ids, self.positions, self.out_cache_loc):
                buf[bs:padded].zero_()
            self.seq_lens[bs:padded].fill_(1)
        self.runner.attn.fill_replay(fb, padded)  # type: ignore[attr-defined]
        self.graphs[padded].replay()
        return self.logits[padded][:bs]
