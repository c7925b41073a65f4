"""What one forward pass needs to know about its batch, in tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ForwardBatch", "ForwardMode"]


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: new tokens of each request after its cached prefix
    DECODE = "decode"  # one new token per request


@dataclass
class ForwardBatch:
    """Tensors of one step. ``N`` = new tokens in the step, ``B`` = requests.

    Before the forward pass, the KV slots of the new tokens (``out_cache_loc``) are already
    written into each request's ``req_to_token`` row, so a request's full context is
    ``req_to_token[req_pool_indices[i], :seq_lens[i]]``.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    out_cache_loc: torch.Tensor  # [N] KV slots the new tokens write
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] context length after this step
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)  # EXTEND only
    extend_seq_lens_cpu: list[int] = field(default_factory=list)  # EXTEND only
    # EXTEND only: logit rows each request needs before its last token's (prompt logprobs)
    extend_logit_extras_cpu: list[int] = field(default_factory=list)
    # each request's LoRA adapter (None: the base model); empty without adapters
    lora_paths: list[str | None] = field(default_factory=list)
    # an EAGLE head's input features, one row per new token (None for every other model)
    input_hidden: torch.Tensor | None = None
    attn_metadata: Any = None  # filled by the attention backend's init_forward_metadata

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    def logits_rows(self) -> torch.Tensor:
        """Index of each request's last new token in ``[N]`` (where its logits come from),
        preceded by its ``extend_logit_extras_cpu`` tokens before it, if any."""
        if self.is_decode:
            return torch.arange(self.batch_size, device=self.input_ids.device)
        if any(self.extend_logit_extras_cpu):
            rows: list[int] = []
            end = 0
            for extend_len, extra in zip(
                self.extend_seq_lens_cpu, self.extend_logit_extras_cpu, strict=True
            ):
                end += extend_len
                rows += range(end - 1 - extra, end)
            return torch.tensor(rows, device=self.input_ids.device)
        ends = torch.tensor(self.extend_seq_lens_cpu, device=self.input_ids.device).cumsum(0)
        return ends - 1

    def last_logit_rows(self) -> list[int]:
        """Where each request's last-token logits are among the rows of :meth:`logits_rows`."""
        if not any(self.extend_logit_extras_cpu):
            return list(range(self.batch_size))
        rows, at = [], -1
        for extra in self.extend_logit_extras_cpu:
            at += extra + 1
            rows.append(at)
        return rows
