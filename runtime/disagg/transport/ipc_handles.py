"""CUDA IPC memory handles through the driver API (``libcuda.so.1``, ctypes): export a
device buffer of this process, open a peer's in this one.

A handle names a whole ``cudaMalloc`` allocation, and PyTorch's caching allocator hands out
pieces of larger blocks, so an exported buffer is (the handle of its block, its offset in
the block). The driver only opens a handle in another process than the one that made it,
with a CUDA context current on the calling thread (:func:`bind_context`).
"""

from __future__ import annotations

import base64
import ctypes
import functools
from typing import NamedTuple

__all__ = ["Exported", "bind_context", "close", "export", "mapped_size", "open_handle"]

_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _HANDLE_BYTES)]


class Exported(NamedTuple):
    """A buffer as a peer opens it: its block's handle (base64), where the buffer starts
    in the block, and its length."""

    handle: str
    offset: int
    nbytes: int


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise OSError(f"the CUDA driver (libcuda.so.1) is not available: {err}") from err
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    return lib


def bind_context(ordinal: int) -> None:
    """Make device ``ordinal``'s primary context (the one the CUDA runtime, and so torch,
    uses) current on this thread if none is: driver calls act on the thread's current
    context, and a thread that only ever asked torch for its device has none (torch skips
    ``cudaSetDevice`` when the device is already the current one)."""
    lib = _driver()
    current = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if current.value:
        return
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")


def _check(status: int, what: str) -> None:
    if status != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(status, ctypes.byref(text))
        name = text.value.decode() if text.value else "unknown error"
        raise OSError(f"{what} failed: CUDA error {status} ({name})")


def _range(ptr: int) -> tuple[int, int]:
    """The allocation holding device address ``ptr``: (base, size)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(
        _driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
        "cuMemGetAddressRange",
    )
    return base.value, size.value


def export(ptr: int, nbytes: int) -> Exported:
    """The handle a peer process opens to reach ``nbytes`` at device address ``ptr``."""
    base, size = _range(ptr)
    if ptr + nbytes > base + size:
        raise OSError(
            f"{nbytes} bytes at {ptr:#x} run past their allocation ({size} bytes at {base:#x})"
        )
    handle = _Handle()
    _check(_driver().cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
    # NOTE: bytes(handle), not handle.reserved: a c_char array reads as bytes up to its
    # first NUL, and handles hold NULs
    return Exported(base64.b64encode(bytes(handle)).decode(), ptr - base, nbytes)


def open_handle(handle: str) -> int:
    """Map a peer's allocation into this process (the current device's context); returns
    its base address here. Raises ``ValueError`` for a handle that is not one."""
    raw = base64.b64decode(handle, validate=True)
    if len(raw) != _HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle is {_HANDLE_BYTES} bytes, not {len(raw)}")
    opened = ctypes.c_uint64()
    _check(
        _driver().cuIpcOpenMemHandle_v2(
            ctypes.byref(opened), _Handle(raw), _LAZY_ENABLE_PEER_ACCESS
        ),
        "cuIpcOpenMemHandle",
    )
    return opened.value


def mapped_size(base: int) -> int:
    """Bytes of the allocation mapped at ``base`` (what a peer's claims are checked
    against: a handle says nothing about its size)."""
    return _range(base)[1]


def close(base: int) -> None:
    _check(_driver().cuIpcCloseMemHandle(base), "cuIpcCloseMemHandle")
