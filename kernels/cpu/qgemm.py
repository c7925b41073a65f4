"""Weight-only quantized matmuls of few rows on CPU (``qgemm.c``): ``x @ weight.T`` with the
weight in a GGUF block format, dequantized inside the matmul; activations float32 or
bfloat16, products summed in float32, the output rounded once to ``x``'s dtype.

GGUF stores a weight ``[N, K]`` as rows of blocks of 32 ``k`` (:data:`BLOCK_TYPES`):
Q8_0 = fp16 scale ``d`` + 32 int8 ``q`` (``w = d q``); Q4_1 = fp16 ``d``, fp16 ``m`` + 16
bytes of nibbles (byte ``j``: ``k = j`` low, ``k = j + 16`` high; ``w = d q + m``).
:func:`pack` repacks those bytes once (same size, only moved) into panels of 16 columns
(``N`` padded with zero columns, ``P = ceil(N / 16)``), panel-major so a thread streams one
panel over the whole ``K``: a uint8 tensor ``[P, K / 32, block bytes]`` where one panel's
block is

- ``Q8_0`` (544 bytes): ``d[16]`` fp16 (one per column), then ``q[32][16]`` int8 (row ``k``
  holds the 16 columns' quants, one FMA operand);
- ``Q4_1`` (320 bytes): ``d[16]``, ``m[16]`` fp16, then ``[16][16]`` bytes, byte ``(j, c)``
  GGUF's byte ``j`` of column ``c`` (``k = j`` and ``j + 16``);
- ``Q4_1`` for bfloat16 activations (320 bytes, AVX512-BF16): ``d[16]``, ``m[16]``, then 8
  chunks of 32 bytes; byte ``2c + kk`` of chunk ``j`` holds column ``c``'s ``k = 4j + kk``
  (low nibble) and ``k = 4j + 2 + kk`` (high), so a chunk widened to 16-bit lanes is
  ``vdpbf16ps``'s column pairs of two ``k`` pairs (see ``qgemm.c`` for the 128 + q trick).

From 16 rows on the kernel dequantizes each panel pair once into float32 and runs dense
tiles on it (same contract; see ``qgemm.c``).

:func:`qgemm_ref` is the contract in torch: dequantize (``gguf.quants``), then
:func:`~kvflow.kernels.cpu.gemm.gemm_ref`.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from kvflow.kernels.cpu.build import function
from kvflow.kernels.cpu.gemm import PANEL, gemm_ref

__all__ = [
    "BLOCK_TYPES",
    "QuantPacked",
    "dequantize",
    "dequantize_rows",
    "pack",
    "qgemm",
    "qgemm_ref",
    "supports",
]

BLOCK = 32  # k per GGUF block of the served types
# GGUF block type name -> (bytes per block, the C layout of its portable panels)
BLOCK_TYPES = {"Q8_0": (34, 0), "Q4_1": (20, 1)}
_Q4_1_BF16 = 2  # the C layout of Q4_1 panels for vdpbf16ps
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_QGEMM = [_PTR, _I64, _PTR, _INT, _I64, _I64, _I64, _PTR, _I64, _INT]


@functools.cache
def _caps() -> int:
    return int(function("kvflow_qgemm_caps", [], ctypes.c_int)())


@dataclass(frozen=True)
class QuantPacked:
    """A GGUF weight ``[n, k]`` in the kernel's panels (:func:`pack`): ``panels`` uint8
    ``[P, k / 32, block bytes]``, ``layout`` the C kernel's layout number, ``dtype`` the
    activation dtype it was packed for (the bfloat16 Q4_1 layout takes only bfloat16)."""

    block_type: str
    n: int
    k: int
    panels: torch.Tensor
    layout: int
    dtype: torch.dtype

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The activation dtypes :func:`qgemm` takes on these panels."""
        if self.layout == _Q4_1_BF16:
            return (torch.bfloat16,)
        return (torch.float32, torch.bfloat16)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether :func:`qgemm` runs ``x`` on this weight."""
        return x.device.type == "cpu" and x.dtype in self.dtypes and x.shape[-1] == self.k


def supports(block_type: str, k: int) -> bool:
    """Whether the kernels take a weight of this GGUF block type and ``k`` columns here."""
    return block_type in BLOCK_TYPES and k % BLOCK == 0 and bool(_caps() & 1)


def _rows_in_panels(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """``raw`` uint8 ``[N, B * block_bytes]`` -> ``[P, 16, B, block_bytes]`` (zero rows pad N)."""
    n = raw.shape[0]
    padded = -(-n // PANEL) * PANEL
    if padded != n:
        raw = np.concatenate([raw, np.zeros((padded - n, raw.shape[1]), np.uint8)])
    return raw.reshape(padded // PANEL, PANEL, -1, block_bytes)


def pack(raw: torch.Tensor, block_type: str, dtype: torch.dtype) -> QuantPacked:
    """GGUF's rows of blocks, ``raw`` uint8 ``[N, K / 32 * block bytes]``, in the kernel's
    panels for activations of ``dtype`` (a new tensor; see the module docstring).

    NOTE: the byte shuffles run in numpy: torch's copies of permuted uint8 tensors took
    10x longer (seconds over a model's layers)."""
    if block_type not in BLOCK_TYPES or raw.dtype != torch.uint8 or raw.dim() != 2:
        raise ValueError(f"cannot pack a {raw.dtype} {block_type} tensor of {tuple(raw.shape)}")
    block_bytes, layout = BLOCK_TYPES[block_type]
    n, k = raw.shape[0], raw.shape[1] // block_bytes * BLOCK
    if raw.shape[1] % block_bytes or not supports(block_type, k):
        raise ValueError(f"cannot pack {block_type} rows of {raw.shape[1]} bytes")
    blocks = _rows_in_panels(raw.numpy(), block_bytes)  # [P, 16, B, bytes]
    p, b = blocks.shape[0], blocks.shape[2]

    def by_block(part: np.ndarray) -> np.ndarray:  # [P, 16, B, w] -> [P, B, w * 16]
        return part.transpose(0, 2, 3, 1).reshape(p, b, -1)

    def scales(at: int) -> np.ndarray:  # fp16 bytes -> [P, B, 16 * 2]
        return blocks[..., at : at + 2].transpose(0, 2, 1, 3).reshape(p, b, 2 * PANEL)

    if block_type == "Q8_0":
        parts = [scales(0), by_block(blocks[..., 2:])]
    elif dtype == torch.bfloat16 and _caps() & 2:
        layout = _Q4_1_BF16
        qs = blocks[..., 4:]
        quants = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(p, PANEL, b, 8, 2, 2)
        chunks = quants[..., 0, :] | (quants[..., 1, :] << 4)  # [P, 16, B, j, kk]
        parts = [scales(0), scales(2), chunks.transpose(0, 2, 3, 1, 4).reshape(p, b, -1)]
    else:
        parts = [scales(0), scales(2), by_block(blocks[..., 4:])]
    panels = torch.from_numpy(np.concatenate(parts, axis=-1))
    return QuantPacked(block_type, n, k, panels, layout, dtype)


def qgemm(x: torch.Tensor, weight: QuantPacked, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` ``[M, K]`` (rows contiguous) of a dtype ``weight`` takes;
    ``out`` ``[M, N]`` in ``x``'s dtype (new if None)."""
    m = x.shape[0]
    if x.dim() != 2 or not weight.takes(x) or x.stride(1) != 1:
        raise ValueError(f"x must be [M, {weight.k}] on CPU, rows contiguous, of a packed dtype")
    if out is None:
        out = torch.empty(m, weight.n, dtype=x.dtype)
    elif out.shape != (m, weight.n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {weight.n}] {x.dtype} with contiguous rows")
    status = function("kvflow_qgemm", _QGEMM, ctypes.c_int)(
        x.data_ptr(),
        x.stride(0),
        weight.panels.data_ptr(),
        weight.layout,
        m,
        weight.n,
        weight.k,
        out.data_ptr(),
        out.stride(0),
        int(x.dtype == torch.bfloat16),
    )
    if status != 0:
        raise ValueError(f"no native {weight.block_type} matmul for {x.dtype} here ({status})")
    return out


def dequantize(raw: torch.Tensor, block_type: str) -> torch.Tensor:
    """GGUF rows of blocks (uint8 ``[N, row bytes]``) -> float32 ``[N, K]``, by the ``gguf``
    package."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    kind = GGMLQuantizationType[block_type]
    return torch.from_numpy(gguf_dequantize(raw.numpy(), kind).copy())


def dequantize_rows(weight: QuantPacked, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape) of a Q8_0 weight in its panels, ``[*ids.shape, k]``
    in ``dtype``: each value ``d * q`` in float32 as :func:`dequantize` computes it, then
    rounded once, so bit for bit the rows of ``dequantize(raw).to(dtype)``. An embedding
    lookup on the blocks a tied head holds; gathers only the requested rows' bytes."""
    if weight.layout != BLOCK_TYPES["Q8_0"][1] or weight.block_type != "Q8_0":
        raise ValueError(f"rows are read from Q8_0 panels only, not {weight.block_type}")
    flat = ids.reshape(-1)
    panel, column = flat // PANEL, flat % PANEL
    blocks = weight.panels  # [P, K / 32, 544]: d[16] fp16, then q[32][16] int8
    scales = blocks[..., : 2 * PANEL].view(torch.float16)  # [P, B, 16]
    quants = blocks[..., 2 * PANEL :].view(torch.int8).unflatten(-1, (BLOCK, PANEL))
    d = scales[panel, :, column].float()  # [T, B]
    q = quants[panel, :, :, column].float()  # [T, B, 32]
    return (q * d[..., None]).to(dtype).view(*ids.shape, weight.k)


def qgemm_ref(x: torch.Tensor, raw: torch.Tensor, block_type: str) -> torch.Tensor:
    """Pure-torch :func:`qgemm`: dequantize, then float32 products and sums rounded once."""
    return gemm_ref(x, dequantize(raw, block_type))
