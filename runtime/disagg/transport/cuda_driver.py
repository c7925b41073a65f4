"""The two CUDA driver calls the cuda_ipc transport needs beyond torch (``libcuda.so.1``,
ctypes): which allocation holds a device address (to check a peer's claims against what
was really mapped), and binding the runtime's primary context to a thread that has none."""

from __future__ import annotations

import ctypes
import functools

__all__ = ["allocation_range", "bind_context"]


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
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(status, ctypes.byref(text))
        name = text.value.decode() if text.value else "unknown error"
        raise OSError(f"{what} failed: CUDA error {status} ({name})")


def bind_context(ordinal: int) -> None:
    """Make device ``ordinal``'s primary context (the one torch uses) current on this
    thread if none is: driver calls act on the thread's current context, and a thread that
    only asked torch for its current device has none (torch then skips ``cudaSetDevice``)."""
    lib = _driver()
    current = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if current.value:
        return
    _check(lib.cuCtxSetCurrent(_primary_context(ordinal)), "cuCtxSetCurrent")


def _primary_context(ordinal: int) -> ctypes.c_void_p:
    lib = _driver()
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    return context


def allocation_range(ptr: int) -> tuple[int, int]:
    """The allocation mapped at device address ``ptr`` in this process: (base, size)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(
        _driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
        "cuMemGetAddressRange",
    )
    return base.value, size.value
