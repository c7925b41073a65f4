"""Matmuls of few rows on CPU (``gemm.c``): ``x @ weight.T`` for decode steps, with the weight
packed once in panels of 16 columns.

Layouts (``N`` padded with zero columns to a multiple of 16, ``P = N / 16`` panels):
float32 ``[P, K, 16]`` (panel ``p``, row ``k``: columns ``16p .. 16p + 15`` of row ``k`` of
``weight.T``); bfloat16 ``[P, K / 2, 16, 2]`` (pairs of consecutive ``k`` per column, the
operand layout of ``vdpbf16ps``; ``K`` even). Products are summed in float32 and the output
rounded once to the storage type, as oneDNN and cuBLAS do. bfloat16 needs a CPU with
AVX512-BF16 (:func:`supports`); where the CPU has AMX (and the library was built there),
bfloat16 matmuls with ``K`` a multiple of 32 run on the tile unit, reading the same panels
(:func:`use_amx`; ``KVFLOW_CPU_AMX=0`` turns it off).

A merged ``[gate; up]`` weight packed with ``silu_mul=True`` alternates 16-column blocks of
gate and up, and :func:`gemm` with ``silu_mul=True`` writes ``silu(gate) * up`` straight from
the accumulators (the SwiGLU activation fused into the matmul: the ``[M, 2 * width]``
intermediate is never written), rounded step by step as the unfused pair would round.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvflow.kernels.cpu.build import function

__all__ = ["PANEL", "gemm", "gemm_ref", "pack", "supports", "use_amx"]

PANEL = 16
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_GEMM = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _INT, _INT]


@functools.cache
def _caps() -> int:
    return int(function("kvflow_gemm_caps", [], ctypes.c_int)())


def use_amx(enable: bool | None = None) -> bool:
    """Whether bfloat16 matmuls run on AMX tiles in this process (``k`` a multiple of 32,
    any row count): ``enable`` True asks for them (granted where the library has
    them and Linux gives the process the tile state), False turns them off, None asks."""
    flag = -1 if enable is None else int(enable)
    return bool(function("kvflow_gemm_amx", [_INT], _INT)(flag))


def supports(weight: torch.Tensor, silu_mul: bool = False) -> bool:
    """Whether :func:`pack` and :func:`gemm` take this weight ``[N, K]`` on this machine
    (with ``silu_mul``: a merged ``[gate; up]`` of two halves of a multiple of 16 rows)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if silu_mul and weight.shape[0] % (2 * PANEL) != 0:
        return False
    if weight.dtype == torch.float32:
        return bool(_caps() & 1)
    return weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and bool(_caps() & 2)


def pack(weight: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
    """``weight`` ``[N, K]`` in the kernel's panel layout (a new tensor); ``silu_mul``: a
    merged ``[gate; up]`` with gate and up blocks alternating (see the module docstring)."""
    if not supports(weight, silu_mul):
        raise ValueError(f"cannot pack a {weight.dtype} weight of shape {tuple(weight.shape)}")
    n, k = weight.shape
    if silu_mul:  # [gate; up] -> gate block 0, up block 0, gate block 1, ...
        weight = weight.view(2, n // (2 * PANEL), PANEL, k).transpose(0, 1).reshape(n, k)
    if n % PANEL:
        padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=weight.dtype)
        padded[:n] = weight
        weight = padded
    panels = weight.reshape(-1, PANEL, k)
    if weight.dtype == torch.float32:
        return panels.permute(0, 2, 1).contiguous()  # [P, K, 16]
    return panels.view(-1, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()  # [P, K/2, 16, 2]


def gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    out: torch.Tensor | None = None,
    silu_mul: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` ``[M, K]`` and ``packed = pack(weight, silu_mul)``
    (``n`` = the weight's row count); ``out`` ``[M, n]`` (``[M, n / 2]``, ``silu(gate) * up``,
    with ``silu_mul``; new if None) in ``x``'s dtype. ``bias`` ``[n]`` is added in float32
    before the output is rounded (as a fused-bias matmul does)."""
    m, k = x.shape
    width = n // 2 if silu_mul else n
    if x.dtype != packed.dtype or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError("x must be a CPU tensor of the packed weight's dtype, rows contiguous")
    if packed.numel() != -(-n // PANEL) * PANEL * k:
        raise ValueError(f"packed weight does not hold {n} columns of {k}")
    if silu_mul and n % (2 * PANEL) != 0:
        raise ValueError(f"silu_mul needs gate and up halves of a multiple of {PANEL} columns")
    lanes = None
    if bias is not None:
        if silu_mul or bias.shape != (n,):
            raise ValueError(f"bias must be [{n}] (and is not taken with silu_mul)")
        lanes = torch.zeros(-(-n // PANEL) * PANEL, dtype=torch.float32)
        lanes[:n] = bias
    if out is None:
        out = torch.empty(m, width, dtype=x.dtype)
    elif out.shape != (m, width) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {width}] {x.dtype} with contiguous rows")
    status = function("kvflow_gemm", _GEMM, ctypes.c_int)(
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        None if lanes is None else lanes.data_ptr(),
        m,
        n,
        k,
        out.data_ptr(),
        out.stride(0),
        int(silu_mul),
        int(x.dtype == torch.bfloat16),
    )
    if status != 0:
        raise ValueError(f"no native {x.dtype} matmul in this build")
    return out


def gemm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Pure-torch :func:`gemm`: float32 products and sums (and bias), rounded once to
    ``x``'s dtype."""
    out = x.float() @ weight.float().T
    return (out if bias is None else out + bias.float()).to(x.dtype)
