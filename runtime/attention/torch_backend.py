"""Attention in plain torch; runs on CPU and CUDA. On CPU it serves the extends of the ``cpu``
backend, and everything where the native kernels cannot build.

The batch is split into *parts*. A padded part attends a group of requests together: their
new tokens padded to the longest (``M``), their contexts read from the paged KV cache padded
to the longest (``L``), one float32 bias for causality and padding, and per KV head two
batched matmuls, so each KV head is read once for all the query heads that share it.
Decode is one padded part with ``M = 1``. An SDPA part is one request through
``scaled_dot_product_attention``: a long prompt with nothing cached (its causal kernel skips
the upper triangle), or a request whose padded scores alone would exceed
:data:`PADDED_SCORE_BYTES`.

With a sliding window (:meth:`AttentionBackend.window`), each request's context starts at
the first key its earliest new token sees, so slots before every query's window are never
gathered; the bias masks the rest of the window. Layers sharing a window share one plan.
With a ``logit_cap`` (Gemma 2), the scores are soft-capped before the bias; SDPA has no
such option, so an SDPA part then runs as explicit matmuls over the same mask.

A pool of another dtype (an FP8 KV cache) is read as ``stored.to(q.dtype) * scale``
(:func:`~kvflow.kernels.dequantize_kv`); an SDPA part then takes its new tokens' K/V back
from the pool too (see :class:`AttentionBackend`).

Why not SDPA everywhere: on CPU, SDPA with an explicit mask takes a slow path (bf16 worst,
~8x slower than the matmuls here), and one call per short request costs more in overhead
than the attention itself. The KV cache is read per head with ``index_select`` on a strided
view, which lands each head's rows contiguous (advanced indexing with a 2-D index is ~6x
slower, and gathering all heads then transposing costs a second copy).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvflow.kernels import dequantize_kv, select_rows, softcap_ref
from kvflow.runtime.attention.base import AttentionBackend
from kvflow.runtime.forward_batch import ForwardBatch

__all__ = ["PADDED_SCORE_BYTES", "SDPA_MIN_NEW_TOKENS", "TorchBackend"]

# Largest float32 score tensor ([requests, new tokens, heads, context]) one padded part builds.
PADDED_SCORE_BYTES = 64 << 20
# A request with nothing cached and at least this many new tokens goes through causal SDPA.
SDPA_MIN_NEW_TOKENS = 256


@dataclass(frozen=True)
class _PaddedPart:
    """Requests attended together, padded to ``max_new`` new tokens and ``max_ctx`` context."""

    q_rows: torch.Tensor  # [R * max_new] row of q at each padded query position (pad: row 0)
    real: torch.Tensor  # [n] padded position of each real query row
    out_rows: torch.Tensor  # [n] row of the output each real query row goes to
    kv_slots: torch.Tensor  # [R * max_ctx] KV slots of each read context (pad: slot 0)
    max_new: int
    max_ctx: int
    bias: torch.Tensor  # [R, max_new, 1, max_ctx] float32: 0 where allowed, -inf elsewhere


@dataclass(frozen=True)
class _SdpaPart:
    """One request through SDPA: its rows ``start:start + new`` of the batch."""

    start: int
    new: int
    prefix_slots: torch.Tensor | None  # cached-prefix slots read; None: none
    mask: torch.Tensor | None  # [new, read prefix + new] bool; None: plain causal


_Part = _PaddedPart | _SdpaPart


class _LayerCache(NamedTuple):
    """One layer's K/V buffers of the pool and their scales (1.0 unless FP8)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: float
    v_scale: float


@dataclass(frozen=True)
class _Request:
    row: int  # req_to_token row
    start: int  # first row of its new tokens in the batch
    prefix: int
    new: int
    first: int = 0  # first context position any new token sees (its window's start)

    @property
    def context(self) -> int:
        return self.prefix + self.new

    @property
    def span(self) -> int:
        """Context positions read: ``first`` up to the last new token."""
        return self.context - self.first

    def windowed(self, window: int | None) -> _Request:
        if window is None:
            return self
        return dataclasses.replace(self, first=max(0, self.prefix - window + 1))


def _visible(q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal, and within ``window`` when one is set (broadcast over the positions)."""
    allowed = kv_pos <= q_pos
    return allowed if window is None else allowed & (q_pos - kv_pos < window)


class TorchBackend(AttentionBackend):
    """Padded grouped matmuls for decode and short extends, SDPA for long prompts."""

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """``fb.attn_metadata``: the parts of each window the layers use (None: full)."""
        if fb.is_decode:
            prefixes, news = [n - 1 for n in fb.seq_lens_cpu], [1] * fb.batch_size
        else:
            prefixes, news = fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
        requests, start = [], 0
        for row, prefix, new in zip(fb.req_pool_indices.tolist(), prefixes, news, strict=True):
            requests.append(_Request(int(row), start, prefix, new))
            start += new
        windows = set(self.layer_windows) or {None}
        fb.attn_metadata = {
            window: self._plan(requests, fb.input_ids.device, window) for window in windows
        }

    def _plan(
        self, requests: list[_Request], device: torch.device, window: int | None
    ) -> list[_Part]:
        """Pack requests of similar read span into padded parts that fit the budget.

        Requests go in ascending span order, so a group's longest span is its latest.
        """
        parts: list[_Part] = []
        group: list[_Request] = []
        group_new = 0  # longest new-token count in ``group``
        windowed = (req.windowed(window) for req in requests)
        for req in sorted(windowed, key=lambda r: r.span):
            if req.prefix == 0 and req.new >= SDPA_MIN_NEW_TOKENS:
                parts.append(self._sdpa_part(req, device, window))
                continue
            new = max(group_new, req.new)
            if self._score_bytes(len(group) + 1, new, req.span) <= PADDED_SCORE_BYTES:
                group.append(req)
                group_new = new
                continue
            if group:
                parts.append(self._padded_part(group, device, window))
            if self._score_bytes(1, req.new, req.span) <= PADDED_SCORE_BYTES:
                group, group_new = [req], req.new
            else:
                group, group_new = [], 0
                parts.append(self._sdpa_part(req, device, window))
        if group:
            parts.append(self._padded_part(group, device, window))
        return parts

    def _score_bytes(self, count: int, max_new: int, max_ctx: int) -> int:
        return 4 * count * max_new * self.num_heads * max_ctx

    def _padded_part(
        self, group: list[_Request], device: torch.device, window: int | None
    ) -> _PaddedPart:
        """Index tensors built from host lists, and every context read from the
        request-to-token table in one gather (a few ops per part, not per request)."""
        count = len(group)
        max_new = max(r.new for r in group)
        max_ctx = max(r.span for r in group)
        q_rows = [0] * (count * max_new)  # padding reads row 0, results are dropped
        real: list[int] = []
        out_rows: list[int] = []
        for i, req in enumerate(group):
            base = i * max_new
            q_rows[base : base + req.new] = range(req.start, req.start + req.new)
            real.extend(range(base, base + req.new))
            out_rows.extend(range(req.start, req.start + req.new))
        table = self.req_to_token.req_to_token
        rows = torch.tensor([r.row for r in group], device=table.device)
        context = torch.tensor([r.context for r in group])
        first = torch.tensor([r.first for r in group])
        positions = first[:, None] + torch.arange(max_ctx)[None, :]  # [R, max_ctx]
        kv_pad = positions >= context[:, None]
        columns = positions.clamp(max=table.shape[1] - 1).to(table.device)
        kv_slots = table.index_select(0, rows).gather(1, columns).to(torch.int64)
        kv_slots.masked_fill_(kv_pad.to(kv_slots.device), 0)  # padding reads slot 0
        prefix = torch.tensor([r.prefix for r in group])[:, None, None]
        # padding query rows stand at their request's last position, so each sees a key
        q_pos = torch.minimum(
            torch.arange(max_new)[None, :, None] + prefix, context[:, None, None] - 1
        )
        kv_pos = positions[:, None, :]
        allowed = _visible(q_pos, kv_pos, window) & ~kv_pad[:, None, :]
        bias = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, -torch.inf)
        return _PaddedPart(
            q_rows=torch.tensor(q_rows, device=device),
            real=torch.tensor(real, device=device),
            out_rows=torch.tensor(out_rows, device=device),
            kv_slots=kv_slots.view(-1).to(device),
            max_new=max_new,
            max_ctx=max_ctx,
            bias=bias[:, :, None, :].to(device),
        )

    def _sdpa_part(self, req: _Request, device: torch.device, window: int | None) -> _SdpaPart:
        if req.prefix == 0 and window is None:
            return _SdpaPart(req.start, req.new, None, None)
        q_pos = torch.arange(req.prefix, req.context, device=device)
        kv_pos = torch.arange(req.first, req.context, device=device)
        prefix_slots = None
        if req.first < req.prefix:
            prefix_slots = self.req_to_token.read(req.row, req.prefix, req.first)
        return _SdpaPart(
            req.start, req.new, prefix_slots, _visible(q_pos[:, None], kv_pos[None, :], window)
        )

    def forward_extend(self, q, k, v, layer_id, fb):
        return self._attend(q, k, v, layer_id, fb)

    def forward_decode(self, q, k, v, layer_id, fb):
        return self._attend(q, k, v, layer_id, fb)

    def _attend(self, q, k, v, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        pool = self.kv_pool
        cache = _LayerCache(
            pool.k_buffer[layer_id],
            pool.v_buffer[layer_id],
            pool.k_scales[layer_id],
            pool.v_scales[layer_id],
        )
        parts = fb.attn_metadata[self.window(layer_id)]
        if self.reads_stored_kv and not all(isinstance(p, _PaddedPart) for p in parts):
            # padded parts read the pool; SDPA parts take the new tokens' k and v
            k, v = pool.read(layer_id, fb.out_cache_loc, q.dtype)
        for part in parts:
            if isinstance(part, _PaddedPart):
                rows = self._padded(q, cache, part).index_select(0, part.real)
                out.index_copy_(0, part.out_rows, rows)
            else:
                out[part.start : part.start + part.new] = self._sdpa(q, k, v, cache, part)
        return out

    def _padded(self, q, cache: _LayerCache, part: _PaddedPart) -> torch.Tensor:
        """``[R * max_new, heads, D]`` attention output at every padded query position."""
        kv_heads, dim = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        count = part.kv_slots.numel() // part.max_ctx
        queries = q.index_select(0, part.q_rows) * self.scale  # scaled once, not the scores
        queries = queries.view(count, part.max_new, kv_heads, group, dim)
        bias = part.bias.to(q.dtype)  # 0 / -inf: exact in any float dtype
        out = torch.empty_like(queries)
        for h in range(kv_heads):
            keys = select_rows(cache.k[:, h], part.kv_slots).view(count, part.max_ctx, dim)
            values = select_rows(cache.v[:, h], part.kv_slots).view(count, part.max_ctx, dim)
            keys = dequantize_kv(keys, cache.k_scale, q.dtype)
            values = dequantize_kv(values, cache.v_scale, q.dtype)
            qh = queries[:, :, h].reshape(count, part.max_new * group, dim)
            scores = softcap_ref(torch.bmm(qh, keys.transpose(1, 2)), self.logit_cap)
            scores = scores.view(count, part.max_new, group, part.max_ctx).add_(bias)
            # softmax accumulates in float32 for half types on CPU and CUDA alike
            probs = torch.softmax(scores, dim=-1).view(count, part.max_new * group, part.max_ctx)
            out[:, :, h] = torch.bmm(probs, values).view(count, part.max_new, group, dim)
        return out.view(count * part.max_new, self.num_heads, dim)

    def _sdpa(self, q, k, v, cache: _LayerCache, part: _SdpaPart) -> torch.Tensor:
        rows = slice(part.start, part.start + part.new)
        keys, values = k[rows], v[rows]
        if part.prefix_slots is not None:
            prefix_k = select_rows(cache.k, part.prefix_slots)
            prefix_v = select_rows(cache.v, part.prefix_slots)
            keys = torch.cat([dequantize_kv(prefix_k, cache.k_scale, q.dtype), keys])
            values = torch.cat([dequantize_kv(prefix_v, cache.v_scale, q.dtype), values])
        if self.logit_cap is not None:
            return self._capped(q[rows], keys, values, part.mask)
        out = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=part.mask,
            is_causal=part.mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def _capped(self, q, keys, values, mask: torch.Tensor | None) -> torch.Tensor:
        """Soft-capped attention of one request's ``q`` ``[n, heads, D]`` over ``keys`` /
        ``values`` ``[ctx, kv_heads, D]`` (``mask`` ``[n, ctx]``; None: causal, ctx = n)."""
        group = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.bmm(q.transpose(0, 1) * self.scale, keys.transpose(1, 2))
        scores = softcap_ref(scores, self.logit_cap)
        if mask is None:
            mask = torch.ones(scores.shape[1:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, -torch.inf)
        return torch.bmm(torch.softmax(scores, dim=-1), values).transpose(0, 1)
