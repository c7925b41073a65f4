"""STANDALONE drafting: a smaller model of the same tokenizer drafts greedily, chained,
with its own weights, KV pool and request rows (a second :class:`ModelRunner`).

Per request the draft keeps KV for positions ``0:kv_len`` of the request's tokens. A step
first runs the tokens it has not seen (the prompt at first, then the tokens the last step
kept) and takes its argmax as ``d_1``, then one forward per further draft::

    step:   catch-up extend over [kv_len, L)  ->  d_1;  d_1 at L -> d_2;  ...  d_k-1 -> d_k

so KV is written up to position ``L + k - 2``. Once the target kept ``u`` drafts, the
draft's KV is valid below ``L + min(u, k - 1)``; the pages past that are freed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvflow.runtime.config import EngineConfig
from kvflow.runtime.core import Req
from kvflow.runtime.model_runner import ModelRunner
from kvflow.runtime.speculative.base import Drafter
from kvflow.runtime.speculative.batch import build_token_batch

__all__ = ["StandaloneDrafter"]


@dataclass
class _DraftSeq:
    """One request's state in the draft's pool."""

    row: int
    kv_len: int = 0
    last_loc: int = 0  # slot of position kv_len - 1
    slots: list[int] = field(default_factory=list)  # taken this step, from position kv_len
    seq_len: int = 0  # the request's length when this step drafted
    num_drafts: int = 0


class StandaloneDrafter(Drafter):
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
            disable_cuda_graph=True,
            max_total_tokens=target.allocator.size,
            enable_lora=False,
            lora_paths=(),
            quantization=None,
        )
        self.runner = ModelRunner(draft_config)
        if self.runner.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({self.runner.vocab_size}) is not the "
                f"target's ({target.vocab_size}): STANDALONE needs the same tokenizer"
            )
        self._seqs: dict[int, _DraftSeq] = {}  # by id(req)
        self._reqs: dict[int, Req] = {}

    def _seq(self, req: Req) -> _DraftSeq | None:
        if self._reqs.get(id(req), req) is not req:  # another request at a reused address
            self.forget(self._reqs[id(req)])
        seq = self._seqs.get(id(req))
        if seq is None:
            row = self.runner.req_to_token.alloc()
            if row is None:
                return None
            seq = self._seqs[id(req)] = _DraftSeq(row)
            self._reqs[id(req)] = req
        return seq

    def _take(self, seq: _DraftSeq, num_new: int) -> bool:
        runner = self.runner
        slots = runner.allocator.alloc_for_request(seq.kv_len, seq.last_loc, num_new)
        if slots is None:
            return False
        on_device = torch.tensor(slots, dtype=torch.int64, device=runner.device)
        runner.req_to_token.write(seq.row, seq.kv_len, on_device)
        seq.slots = slots
        return True

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Req], max_drafts: Sequence[int]) -> list[list[int]]:
        live = {id(r) for r in reqs}
        for key in [k for k in self._seqs if k not in live]:  # left without forget()
            self.forget(self._reqs[key])
        drafts: list[list[int]] = [[] for _ in reqs]
        active: list[tuple[int, Req, _DraftSeq]] = []
        for i, (req, limit) in enumerate(zip(reqs, max_drafts, strict=True)):
            seq = self._seqs.get(id(req))
            if seq is not None:
                seq.num_drafts = 0
            if limit <= 0 or req.seq_len + limit > self.runner.context_len:
                continue  # (the draft's context may be shorter than the target's)
            seq = self._seq(req)
            if seq is None or not self._take(seq, req.seq_len - seq.kv_len + limit - 1):
                continue
            seq.seq_len, seq.num_drafts = req.seq_len, limit
            active.append((i, req, seq))
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
            slots: list[int] = []
            for k in group:
                seq, offset = active[k][2], starts[k] - active[k][2].kv_len
                slots += seq.slots[offset : offset + len(feed[k])]
            fb = build_token_batch(
                [active[k][2].row for k in group],
                [starts[k] for k in group],
                [feed[k] for k in group],
                torch.tensor(slots, dtype=torch.int64, device=self.runner.device),
                self.runner.device,
                all_logits=False,
            )
            next_ids = self.runner.forward(fb).argmax(dim=-1).tolist()
            for k, token in zip(group, next_ids, strict=True):
                i, _, seq = active[k]
                drafts[i].append(token)
                starts[k] += len(feed[k])
                feed[k] = [token] if len(drafts[i]) < seq.num_drafts else []

    def accepted(self, req: Req, num_accepted: int) -> None:
        seq = self._seqs.get(id(req))
        if seq is None or not seq.num_drafts:
            return
        start = seq.kv_len
        seq.kv_len = seq.seq_len + min(num_accepted, seq.num_drafts - 1)
        page = self.runner.page_size
        keep_end = -(-seq.kv_len // page) * page
        dead = seq.slots[max(keep_end - start, 0) :]
        if dead:
            self.runner.allocator.free(torch.tensor(dead, dtype=torch.int64))
        seq.last_loc = seq.slots[seq.kv_len - 1 - start]
        seq.slots, seq.num_drafts = [], 0

    def forget(self, req: Req) -> None:
        seq = self._seqs.pop(id(req), None)
        self._reqs.pop(id(req), None)
        if seq is None:
            return
        end = seq.kv_len + len(seq.slots)
        if end > 0:
            self.runner.allocator.free(self.runner.req_to_token.read(seq.row, end))
        self.runner.req_to_token.free(seq.row)

    def is_memory_free(self) -> bool:
        runner = self.runner
        return (
            not self._seqs
            and runner.allocator.available_size() == runner.allocator.size
            and runner.req_to_token.available_size() == runner.req_to_token.size
        )
