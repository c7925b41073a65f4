"""STANDALONE drafting: a smaller model of the same tokenizer drafts greedily, chained,
with its own weights, KV pool and request rows (a second :class:`ModelRunner`).

Per request the draft keeps KV for positions ``0:kv_len`` of the request's tokens. A step
first runs the tokens it has not seen (the prompt at first, then the tokens the last step
kept) and takes its argmax as ``d_1``, then one forward per further draft::

    step:   catch-up extend over [kv_len, L)  ->  d_1;  d_1 at L -> d_2;  ...  d_k-1 -> d_k

so KV is written up to position ``L + k - 2``. Once the target kept ``u`` drafts, the
draft's KV is valid below ``L + min(u, k - 1)``; the pages past that are freed. The
one-token forwards are decode batches, in the draft's CUDA graphs on CUDA
(:mod:`~kvflow.runtime.speculative.draft_graphs`: the graph returns the argmax ids).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvflow.runtime.config import EngineConfig
from kvflow.runtime.core import Req
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.model_runner import ModelRunner
from kvflow.runtime.speculative.draft_graphs import capture_draft_graphs
from kvflow.runtime.speculative.pooled import DraftSeq, PooledDrafter

__all__ = ["StandaloneDrafter"]


class StandaloneDrafter(PooledDrafter):
    """Greedy chain drafts from a second model (``config.speculative_draft_model_path``)."""

    def __init__(self, config: EngineConfig, target: ModelRunner) -> None:
        path = config.speculative_draft_model_path
        if not path:
            raise ValueError(
                "--speculative-algorithm STANDALONE needs --speculative-draft-model-path"
            )
        draft_config = dataclasses.replace(
            config,
            model_path=path,
            speculative_algorithm=None,
            speculative_draft_model_path=None,
            # NOTE: the runner's own graphs would return logits; the drafter captures its
            # decode steps itself (argmax ids), below, unless the target's config says not
            disable_cuda_graph=True,
            max_total_tokens=target.allocator.size,
            enable_lora=False,
            lora_paths=(),
            quantization=None,
        )
        super().__init__(ModelRunner(draft_config))
        if self.runner.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({self.runner.vocab_size}) is not the "
                f"target's ({target.vocab_size}): STANDALONE needs the same tokenizer"
            )
        self.graphs = capture_draft_graphs(config, self.runner, target, self._greedy_ids)

    def _greedy_ids(self, fb: ForwardBatch) -> torch.Tensor:
        """The draft's argmax after each request's last new token (metadata ready)."""
        return self.runner.run_model(fb).argmax(dim=-1)

    def _draft_ids(self, fb: ForwardBatch) -> torch.Tensor:
        """The greedy draft after each request's last new token, ``[B]`` (on the device)."""
        graphs = self._graphed(fb)
        if graphs is not None:
            return graphs.replay(fb)
        return self.runner.forward(fb).argmax(dim=-1)

    def _new_slots(self, req: Req, seq: DraftSeq, num_drafts: int) -> int:
        return req.seq_len - seq.kv_len + num_drafts - 1

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Req], max_drafts: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        active = self._start(reqs, max_drafts)
        if not active:
            return drafts
        # step 0: the tokens the draft has not seen, ending at the request's last token;
        # then one token per step (the draft just made), while a request wants more
        feed = [req.all_token_ids()[seq.kv_len :] for _, req, seq in active]
        starts = [seq.kv_len for _, _, seq in active]
        while True:
            group = [k for k, new in enumerate(feed) if new]
            if not group:
                return drafts
            fb = self._group_batch(active, group, starts, feed)
            next_ids = self._draft_ids(fb).tolist()
            for k, token in zip(group, next_ids, strict=True):
                i, _, seq = active[k]
                drafts[i].append(token)
                starts[k] += len(feed[k])
                feed[k] = [token] if len(drafts[i]) < seq.num_drafts else []

    def accepted(self, req: Req, num_accepted: int) -> None:
        seq = self._seqs.get(id(req))
        if seq is not None and seq.num_drafts:
            self._keep(seq, seq.seq_len + min(num_accepted, seq.num_drafts - 1))
