"""The stored form of one page, and byte views of the caller's page buffers.

Every page object is a fixed-size header followed by the page's bytes::

    0        8               16       20       22                         128
    | magic  | payload length | crc32  | keylen | key (utf-8, zero-padded) | payload ...
      8 B      u64 LE           u32 LE   u16 LE   up to MAX_KEY_BYTES

A reader accepts a page only when the magic, the length (equal to its buffer's size), the
key (equal to the key it asked for) and the CRC-32 of the payload all match; anything else
is a miss. The header has a fixed size so that a store can scatter an object into a header
slot and the caller's buffer without a staging copy.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import numpy as np

__all__ = [
    "HEADER_BYTES",
    "MAX_KEY_BYTES",
    "PageBuffer",
    "buffer_address",
    "byte_view",
    "check_header",
    "encode_header",
    "payload_crc",
]

MAGIC = b"KVFLPG01"
_FIXED = struct.Struct("<8sQIH")
HEADER_BYTES = 128
MAX_KEY_BYTES = HEADER_BYTES - _FIXED.size

# A page buffer: a contiguous CPU torch tensor, a numpy array, a bytearray or a memoryview.
# Its size in bytes is the page's size; ``get`` writes into it, ``put`` reads it.
PageBuffer = Any


def byte_view(buffer: PageBuffer) -> np.ndarray:
    """A flat ``uint8`` numpy view of ``buffer``'s memory (no copy).

    Torch tensors must be contiguous and on the CPU; any dtype (bfloat16 included) is viewed
    as raw bytes. Raises ValueError for anything that cannot be viewed in place.
    """
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "is_contiguous"):  # torch, lazily
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("a page buffer tensor must be contiguous and on the CPU")
        import torch

        return buffer.detach().reshape(-1).view(torch.uint8).numpy()
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("a page buffer array must be C-contiguous")
        return buffer.reshape(-1).view(np.uint8)
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("a page buffer must be contiguous")
    return np.frombuffer(view.cast("B"), dtype=np.uint8)


def buffer_address(view: np.ndarray) -> int:
    """Address of a :func:`byte_view`'s first byte (for stores that take raw pointers)."""
    return int(view.ctypes.data)


def payload_crc(payload: np.ndarray) -> int:
    return zlib.crc32(payload.data) & 0xFFFFFFFF


def encode_header(key: str, payload: np.ndarray) -> bytes:
    """The header of ``payload`` stored under ``key`` (computes the CRC)."""
    raw_key = key.encode()
    if len(raw_key) > MAX_KEY_BYTES:
        raise ValueError(f"page key is {len(raw_key)} bytes, more than {MAX_KEY_BYTES}")
    fixed = _FIXED.pack(MAGIC, payload.nbytes, payload_crc(payload), len(raw_key))
    return (fixed + raw_key).ljust(HEADER_BYTES, b"\x00")


def check_header(header: bytes | memoryview | np.ndarray, key: str, payload_len: int) -> int | None:
    """The stored CRC if ``header`` is a page header for ``key`` with ``payload_len`` bytes,
    else None. The caller still has to compare the CRC with the payload it read."""
    raw = bytes(header[:HEADER_BYTES])
    if len(raw) < HEADER_BYTES:
        return None
    magic, length, crc, key_len = _FIXED.unpack_from(raw)
    if magic != MAGIC or length != payload_len or key_len > MAX_KEY_BYTES:
        return None
    if raw[_FIXED.size : _FIXED.size + key_len] != key.encode():
        return None
    return int(crc)
