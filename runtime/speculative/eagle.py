"""EAGLE drafting (EAGLE-1/2 and EAGLE-3 heads, chains): a small head reads the target's
own hidden states and drafts greedily with the target's embedding.

The target keeps, by KV slot, what its head reads of every position it ran
(:attr:`ModelRunner.hidden_pool`, as SGLang feeds the heads): ``f_p``, the final-norm
hidden state (EAGLE-1/2) or the inputs of three layers, concatenated (EAGLE-3). The
head's position ``p`` pairs the token after it with that feature, ``(t_{p+1}, f_p)``, so
for a request of length ``L`` (the target has run ``0:L-1``) a step is::

    catch-up over [kv_len, L-1): (t_{p+1}, f_p)  ->  h, d_1 = the head's token after h
    d_1 at L-1 with h -> h', d_2;  ...;  d_k-1 at L+k-3 -> d_k

Only the catch-up positions use the target's features, so only they stay: the head's KV
is valid below ``L - 1`` after the step whatever the target kept (the next step catches
up over the kept tokens with their real features, as SGLang's draft extend does).

The one-token forwards are decode batches, in the head's CUDA graphs on CUDA
(:mod:`~kvflow.runtime.speculative.draft_graphs`): the graph's input features are the
head's own outputs (a static buffer of its hidden width), its output the head's hidden
states; the LM head and argmax run after the replay. A catch-up is an eager extend,
unless every request brings one token: then it is a decode batch too, replayed where its
features have the head's width (EAGLE-1/2's target states; EAGLE-3's three target layers
are wider and run eagerly).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvflow.runtime.config import EngineConfig
from kvflow.runtime.core import Req
from kvflow.runtime.cuda_graph import FeatureInput
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.model_runner import ModelRunner
from kvflow.runtime.models import check_draft_model
from kvflow.runtime.models.llama_eagle import LlamaEagleHead
from kvflow.runtime.speculative.draft_graphs import capture_draft_graphs
from kvflow.runtime.speculative.pooled import DraftSeq, PooledDrafter

__all__ = ["EagleDrafter"]


def _head_config(config: EngineConfig, target: ModelRunner) -> EngineConfig:
    """The head's engine config (raises ValueError for a head that does not fit the target,
    :func:`check_draft_model`). The head reads its own safetensors whenever its folder has
    them (a dummy target still gets a real head); without any it follows --load-format."""
    path = check_draft_model(config, target.model_config)
    assert path is not None
    folder = path if path.is_dir() else path.parent
    return dataclasses.replace(
        config,
        model_path=config.speculative_draft_model_path,
        load_format="auto" if any(folder.glob("*.safetensors")) else config.load_format,
        speculative_algorithm=None,
        speculative_draft_model_path=None,
        # NOTE: the runner's own graphs would return logits; the drafter captures the
        # head's decode steps itself (hidden states), unless the target's config says not
        disable_cuda_graph=True,
        max_total_tokens=target.allocator.size,
        enable_lora=False,
        lora_paths=(),
        quantization=None,
    )


class EagleDrafter(PooledDrafter):
    """Greedy chain drafts from an EAGLE or EAGLE-3 head (``config.
    speculative_draft_model_path``; the head's class comes from its checkpoint)."""

    def __init__(
        self, config: EngineConfig, target: ModelRunner, spare_rows: int = 0, graph_rows: int = 1
    ) -> None:
        """``spare_rows``: rows of the head's ``req_to_token`` kept for tree drafts;
        ``graph_rows``: a decode step's rows per running request (a tree's ``topk``), what
        the head's CUDA graphs are captured for (where they are on)."""
        if target.hidden_pool is None:
            raise ValueError("the target keeps no hidden states (not started for EAGLE)")
        super().__init__(ModelRunner(_head_config(config, target), spare_rows=spare_rows))
        head = self.runner.model
        assert isinstance(head, LlamaEagleHead)
        head.share_target(target.model)
        self.head, self.target = head, target
        # (after share_target: the captured forward reads the target's embedding)
        own = FeatureInput(self.runner.model_config.hidden_size, self.runner.dtype)
        self.graphs = capture_draft_graphs(
            config, self.runner, target, self.runner.run_hidden, own, graph_rows
        )

    def _head_out(self, fb: ForwardBatch) -> torch.Tensor:
        """The head's output at each request's last new token, ``[B, hidden]`` (a decode
        batch's replay returns the graph's output, which the next replay overwrites)."""
        graphs = self._graphed(fb)
        if graphs is not None:
            return graphs.replay(fb)
        hidden = self.runner.forward_hidden(fb)
        return hidden if fb.is_decode else hidden[fb.logits_rows()]

    def _new_slots(self, req: Req, seq: DraftSeq, num_drafts: int) -> int:
        return (req.seq_len - 1 - seq.kv_len) + num_drafts - 1

    def _features(self, req: Req, seq: DraftSeq) -> torch.Tensor:
        """The target's features of the catch-up positions ``[seq.kv_len, L - 1)``."""
        target = self.target
        assert target.hidden_pool is not None
        slots = target.req_to_token.read(req.req_pool_idx, req.seq_len - 1, seq.kv_len)
        return target.hidden_pool[slots]

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Req], max_drafts: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        active = self._start(reqs, max_drafts)
        if not active:
            return drafts
        feed = [req.all_token_ids()[seq.kv_len + 1 : req.seq_len] for _, req, seq in active]
        starts = [seq.kv_len for _, _, seq in active]
        features = torch.cat([self._features(req, seq) for _, req, seq in active])
        group = list(range(len(active)))
        while group:
            fb = self._group_batch(active, group, starts, feed)
            fb.input_hidden = features
            hidden = self._head_out(fb)
            next_ids = self.head.draft_ids(hidden).tolist()
            wanted: list[int] = []  # rows of `hidden` whose request drafts again
            for row, (k, token) in enumerate(zip(group, next_ids, strict=True)):
                i, _, seq = active[k]
                drafts[i].append(token)
                starts[k] += len(feed[k])
                feed[k] = [token] if len(drafts[i]) < seq.num_drafts else []
                if feed[k]:
                    wanted.append(row)
            group = [k for k in group if feed[k]]
            features = hidden[wanted]  # (a copy: indexed by a list)
        return drafts

    def accepted(self, req: Req, num_accepted: int) -> None:
        seq = self._seqs.get(id(req))
        if seq is not None and seq.num_drafts:
            self._keep(seq, seq.seq_len - 1)
