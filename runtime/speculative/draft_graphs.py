"""CUDA graphs for a draft model's decode steps (STANDALONE; EAGLE and EAGLE3, chains and
trees).

A draft step's first forward runs the tokens the draft has not seen (an extend, eager);
each forward after it runs one token per drafting request (a tree's: one per frontier
node, in the node's spare row): a decode batch
(:func:`~kvflow.runtime.speculative.batch.build_decode_batch`) that replays a graph of
the draft's, captured here once at start-up::

    STANDALONE:  decode batch               -> greedy draft ids            [bs] int64
    EAGLE(3):    decode batch + features    -> the head's hidden states    [bs, hidden]

The captured forward returns what the drafter reads, not logits: a graph's output stays
allocated for every captured size, and ``[bs, vocab]`` float32 rows for each of them would
take gigabytes at Llama-3's vocabulary. An EAGLE head's features (the previous step's
outputs) are a static graph input (:class:`~kvflow.runtime.cuda_graph.FeatureInput`); its
token choice (the LM head and argmax) runs after the replay.

Memory: the graphs capture into the target's graph memory pool, on its capture stream
(:class:`~kvflow.runtime.cuda_graph.CudaGraphRunner`'s ``share``), so their intermediates
reuse what the target's graphs freed; what they add is their static inputs and outputs
(an EAGLE head's: ``[bs, hidden]`` per captured size, 14 MB at Llama-3.1-8B's shapes and
160 rows) and any intermediate that outgrows the target's free blocks (a STANDALONE
draft's float32 logits before the argmax: 82 MB at 160 rows). That comes from the memory
``--mem-fraction-static`` keeps back for activations and graphs, as the target's graphs'
own does; the KV budget (:mod:`kvflow.runtime.models.draft_footprint`) is unchanged.
Rows: ``min(--cuda-graph-max-bs, --max-running-requests x rows_per_request)``, a draft
step's most (a tree's frontier holds ``--speculative-eagle-topk`` nodes per request; a
larger frontier runs eagerly); ``--disable-cuda-graph`` turns these off with the target's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvflow.runtime.config import EngineConfig
from kvflow.runtime.cuda_graph import CudaGraphRunner, FeatureInput, GraphAttention
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.model_runner import ModelRunner

__all__ = ["capture_draft_graphs"]


def capture_draft_graphs(
    config: EngineConfig,
    draft: ModelRunner,
    target: ModelRunner,
    step: Callable[[ForwardBatch], torch.Tensor],
    features: FeatureInput | None = None,
    rows_per_request: int = 1,
) -> CudaGraphRunner | None:
    """``step`` (a decode batch of the ``draft`` runner, its attention metadata ready ->
    one output row per request) captured per batch size, or None where graphs are off
    (``config``, the target's resolved config: off on CPU and with --disable-cuda-graph).
    ``features``: the width and dtype of the batches' ``input_hidden``;
    ``rows_per_request``: a step's rows per running request (a tree's ``topk``)."""
    if config.disable_cuda_graph or not draft.device.startswith("cuda"):
        return None
    if not isinstance(draft.attn, GraphAttention):
        raise ValueError("CUDA graphs need the triton attention backend (or --disable-cuda-graph)")
    max_bs = min(config.cuda_graph_max_bs, config.max_running_requests * rows_per_request)
    graphs = CudaGraphRunner(
        step, draft.attn, draft.device, max_bs, features=features, share=target.graph_runner
    )
    graphs.capture()
    return graphs
