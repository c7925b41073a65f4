"""A Llama-shaped decoder stack's decode step in one native call (``decoder_stack.c``).

:class:`DecoderStack` holds the addresses of every layer's weights (packed for
:mod:`kvflow.kernels.cpu.gemm`), norms and KV pool, fixed once; :meth:`DecoderStack.run`
then runs a step of ``n`` rows, from the token ids to the final norm's output, as the
per-layer path runs it: the same kernels with the same arguments in the same order, so the
result is bit-equal to that path's (the C source lists the sequence). The caller keeps the
tensors alive and in place; the stack keeps references to the ones it is given.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvflow.kernels.cpu.build import function
from kvflow.kernels.cpu.gemm import PANEL

__all__ = ["DecoderStack", "StackLayer", "StackShape"]

_PTR, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, _PTR) for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down")),
        *((name, _PTR) for name in ("qkv_bias", "k_buf", "v_buf")),
        ("window", _I64),
    ]


class _Stack(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.POINTER(_Layer)),
        ("num_layers", _I64),
        *((name, _PTR) for name in ("embedding", "final_norm", "cos_sin", "table")),
        *((name, _I64) for name in ("table_st", "kv_st", "kv_sh")),
        *((name, _INT) for name in ("hidden", "heads", "kv_heads", "head_dim")),
        *((name, _INT) for name in ("intermediate", "is_bf16")),
        *((name, _F32) for name in ("eps", "scale", "logit_cap")),
    ]


_RUN = [ctypes.POINTER(_Stack), _I64, *(_PTR,) * 7]


@dataclass(frozen=True)
class StackShape:
    """The stack's sizes and constants (one RMSNorm ``eps`` for every norm; ``logit_cap``
    None: no soft cap)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float
    logit_cap: float | None = None


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer: RMSNorm weights ``[hidden]``; ``qkv``, ``o``, ``down`` packed by
    :func:`kvflow.kernels.cpu.gemm.pack` and ``gate_up`` packed with ``silu_mul=True``;
    ``qkv_bias`` ``[q + 2 kv columns]`` or None; the layer's K and V pools ``[slots,
    kv_heads, head_dim]``; ``window`` its sliding window (None: full attention)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    qkv_bias: torch.Tensor | None
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    window: int | None = None


def _bias_lanes(bias: torch.Tensor) -> torch.Tensor:
    """``bias`` as the matmul's float32 accumulator start, padded to whole panels (as
    :func:`kvflow.kernels.cpu.gemm.gemm` builds it per call)."""
    lanes = torch.zeros(-(-bias.shape[0] // PANEL) * PANEL, dtype=torch.float32)
    lanes[: bias.shape[0]] = bias
    return lanes


class DecoderStack:
    """Embedding -> layers -> final norm of a decode step, in one native call.

    ``embedding`` ``[vocab, hidden]``, the norms and activations all one dtype (float32 or
    bfloat16), the KV pools of that dtype too; ``cos_sin`` the rotary table (float32
    ``[positions, head_dim]``); ``req_to_token`` the int32 request-to-token table.
    """

    def __init__(
        self,
        shape: StackShape,
        layers: list[StackLayer],
        embedding: torch.Tensor,
        final_norm: torch.Tensor,
        cos_sin: torch.Tensor,
        req_to_token: torch.Tensor,
    ) -> None:
        self.dtype = embedding.dtype
        pool = layers[0].k_buffer
        if self.dtype not in (torch.float32, torch.bfloat16) or pool.dtype != self.dtype:
            raise ValueError(f"a {self.dtype} stack over a {pool.dtype} KV pool")
        if cos_sin.dtype != torch.float32 or req_to_token.dtype != torch.int32:
            raise ValueError("cos_sin must be float32 and req_to_token int32")
        self.shape = shape
        self.hidden = shape.hidden
        lanes = [None if w.qkv_bias is None else _bias_lanes(w.qkv_bias) for w in layers]
        tensors = [embedding, final_norm, cos_sin, req_to_token]
        for layer, bias in zip(layers, lanes, strict=True):
            if layer.k_buffer.stride() != pool.stride() or layer.v_buffer.stride() != pool.stride():
                raise ValueError("every layer's K and V pools must share one layout")
            tensors += [t for t in (*_layer_tensors(layer), bias) if t is not None]
        if not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
            raise ValueError("the stack's tensors must be contiguous CPU tensors")
        self._keep = tensors  # the addresses below stay valid while these live
        self._layers = (_Layer * len(layers))(
            *(_layer_struct(w, b) for w, b in zip(layers, lanes, strict=True))
        )
        self._stack = _Stack(
            self._layers,
            len(layers),
            embedding.data_ptr(),
            final_norm.data_ptr(),
            cos_sin.data_ptr(),
            req_to_token.data_ptr(),
            req_to_token.stride(0),
            pool.stride(0),
            pool.stride(1),
            shape.hidden,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            shape.intermediate,
            int(self.dtype == torch.bfloat16),
            shape.eps,
            shape.scale,
            shape.logit_cap or 0.0,
        )
        self._stack_ref = ctypes.byref(self._stack)
        self._work = torch.empty(0, dtype=torch.uint8)
        self._run = function("kvflow_decoder_stack", _RUN, ctypes.c_int)
        self._work_bytes = function(
            "kvflow_decoder_stack_work", [ctypes.POINTER(_Stack), _I64], _I64
        )

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        loc: torch.Tensor,
        rows: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """The final norm's output ``[n, hidden]`` (a new tensor) of a decode step: ``n``
        tokens ``ids`` at ``positions``, their K/V written to slots ``loc``, row ``i``
        attending to the first ``visible[i]`` slots of table row ``rows[i]`` (all int64
        ``[n]`` contiguous CPU tensors; ids, slots and rows in range: not checked)."""
        n = ids.shape[0]
        need = int(self._work_bytes(self._stack_ref, n))
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.uint8)
        out = torch.empty(n, self.hidden, dtype=self.dtype)
        status = self._run(
            self._stack_ref,
            n,
            ids.data_ptr(),
            positions.data_ptr(),
            loc.data_ptr(),
            rows.data_ptr(),
            visible.data_ptr(),
            self._work.data_ptr(),
            out.data_ptr(),
        )
        if status != 0:
            raise MemoryError(f"decoder stack: no memory for attention's work list of {n} rows")
        return out


def _layer_tensors(layer: StackLayer) -> tuple[torch.Tensor, ...]:
    return (
        layer.input_norm,
        layer.post_norm,
        layer.qkv,
        layer.o,
        layer.gate_up,
        layer.down,
        layer.k_buffer,
        layer.v_buffer,
    )


def _layer_struct(layer: StackLayer, bias: torch.Tensor | None) -> _Layer:
    return _Layer(
        *(t.data_ptr() for t in _layer_tensors(layer)[:6]),
        None if bias is None else bias.data_ptr(),
        layer.k_buffer.data_ptr(),
        layer.v_buffer.data_ptr(),
        layer.window or 0,
    )
