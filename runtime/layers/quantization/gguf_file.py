"""What a GGUF file holds, read from its header (``gguf.GGUFReader`` memory-maps the file;
no tensor is read) and cached per file version: the block type of each linear tensor,
checked against the types the native kernels serve. Torch-free: the CLI calls it before any
process starts."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.runtime.env import cache_dir

__all__ = [
    "SERVED_BLOCK_TYPES",
    "GgufScheme",
    "GgufSource",
    "check_gguf_serving",
    "gguf_name",
    "read_gguf_source",
    "read_tensor",
]

# kvflow.kernels.cpu.qgemm.BLOCK_TYPES (which imports torch)
SERVED_BLOCK_TYPES = ("Q8_0", "Q4_1")


@dataclass(frozen=True)
class GgufScheme:
    """One linear layer's weights as a GGUF file stores them: rows of blocks of
    ``block_type`` (``Q8_0``, ``Q4_1``), run by the native CPU kernels
    (:mod:`kvflow.kernels.cpu.qgemm`)."""

    block_type: str


@dataclass(frozen=True)
class GgufSource:
    """The GGUF file a model's weights are read from (``--quantization gguf``): its
    ``path``, its layer count and the block type of each linear tensor, by GGUF name
    (``blk.3.attn_q``)."""

    path: str
    num_layers: int
    block_types: tuple[tuple[str, str], ...]

    def block_type(self, hf_module: str) -> str | None:
        """The block type of the Hugging Face module's tensor (None: not a linear tensor
        of the file)."""
        return dict(self.block_types).get(gguf_name(hf_module, self.num_layers) or "")

    @property
    def common_block_type(self) -> str:
        """The block type most of the linear tensors have."""
        return Counter(dict(self.block_types).values()).most_common(1)[0][0]


_SCAN_FORMAT = 2  # what _scan records (a new field: a new cache entry)
_SCANS: dict[str, dict[str, Any]] = {}  # this process's scans, by cache key


@functools.cache
def _names(num_layers: int) -> Any:
    from gguf import MODEL_ARCH, get_tensor_name_map

    return get_tensor_name_map(MODEL_ARCH.LLAMA, num_layers)  # builds a big map: once


def gguf_name(hf_module: str, num_layers: int) -> str | None:
    """The GGUF name of a Hugging Face module of a Llama (``model.layers.3.self_attn.q_proj``
    -> ``blk.3.attn_q``; ``lm_head`` -> ``output``), by ``gguf``'s tensor name map."""
    return _names(num_layers).get_name(hf_module)


def _scan(path: Path) -> dict[str, Any]:
    """The header's architecture, layer count and the block type of every linear tensor."""
    from gguf import MODEL_TENSOR, GGUFReader

    reader = GGUFReader(str(path), "r")
    arch, layers = reader.get_field("general.architecture"), reader.get_field("llama.block_count")
    num_layers = int(layers.contents()) if layers is not None else 0
    linear = {
        MODEL_TENSOR.ATTN_Q,
        MODEL_TENSOR.ATTN_K,
        MODEL_TENSOR.ATTN_V,
        MODEL_TENSOR.ATTN_OUT,
        MODEL_TENSOR.FFN_GATE,
        MODEL_TENSOR.FFN_UP,
        MODEL_TENSOR.FFN_DOWN,
    }
    names = _names(num_layers)
    types = {
        tensor.name.removesuffix(".weight"): tensor.tensor_type.name
        for tensor in reader.tensors
        if names.get_type(tensor.name.removesuffix(".weight")) in linear
    }
    # where each tensor's bytes are, so loading memory-maps them without parsing again
    tensors = {
        tensor.name: [
            tensor.tensor_type.name,
            int(tensor.data_offset),
            list(tensor.data.shape),
            tensor.data.dtype.str,
        ]
        for tensor in reader.tensors
    }
    return {
        "arch": arch.contents() if arch is not None else None,
        "num_layers": num_layers,
        "types": types,
        "tensors": tensors,
    }


def _cached_scan(path: Path) -> dict[str, Any]:
    """:func:`_scan`, kept under the kvflow cache per file version.

    NOTE: GGUFReader parses every header field (SmolLM2's 49k-token vocabulary and merges:
    3-5 s on 2 cores); the CLI check and the scheduler would each pay it."""
    stat = path.stat()
    version = f"{_SCAN_FORMAT}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    key = hashlib.sha256(version.encode())
    if key.hexdigest() in _SCANS:
        return _SCANS[key.hexdigest()]
    cached = cache_dir() / "gguf" / f"{key.hexdigest()[:16]}.json"
    try:
        _SCANS[key.hexdigest()] = dict(json.loads(cached.read_text()))
        return _SCANS[key.hexdigest()]
    except (OSError, ValueError):
        pass
    scan = _SCANS[key.hexdigest()] = _scan(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(scan))
        os.replace(tmp, cached)
    except OSError:  # a read-only cache: scan again next time
        pass
    return scan


def read_gguf_source(path: str | Path) -> GgufSource:
    """The Llama GGUF at ``path`` as ``--quantization gguf`` serves it: every projection of
    the decoder layers in a served block type. ValueError (one line) otherwise."""
    path = Path(path)
    scan = _cached_scan(path)
    if scan["arch"] != "llama":
        raise ValueError(
            f"--quantization gguf: {path.name} is a {scan['arch']!r} model; kvflow serves llama"
        )
    types: dict[str, str] = scan["types"]
    for name, block_type in sorted(types.items()):
        if block_type not in SERVED_BLOCK_TYPES:
            raise ValueError(
                f"--quantization gguf: {name}.weight is {block_type}; the CPU kernels serve "
                f"{', '.join(SERVED_BLOCK_TYPES)}"
            )
    if not types:
        raise ValueError(f"--quantization gguf: {path.name} has no quantized projections")
    return GgufSource(str(path), int(scan["num_layers"]), tuple(sorted(types.items())))


def read_tensor(path: str | Path, name: str) -> tuple[str, Any]:
    """The GGUF tensor ``name``: its type name (``Q4_1``, ``F32``, ...) and its data as
    ``GGUFReader`` gives it (uint8 rows of blocks, or the float array), memory-mapped
    read-only at the offset the cached header scan recorded."""
    import numpy as np

    entry = _cached_scan(Path(path))["tensors"].get(name)
    if entry is None:
        raise KeyError(f"{Path(path).name} has no tensor {name}")
    type_name, offset, shape, dtype = entry
    data = np.memmap(path, dtype=np.dtype(dtype), mode="r", offset=offset, shape=tuple(shape))
    return type_name, data


def check_gguf_serving(
    device: str, tp_size: int, load_format: str, enable_lora: bool = False
) -> None:
    """ValueError (one line) where ``--quantization gguf`` cannot run: off CPU (``auto``
    resolving to CUDA included), sharded, without the file's weights, or with LoRA
    adapters (which wrap float projections)."""
    from kvflow.runtime.config import _cuda_available

    if device.startswith("cuda") or (device == "auto" and _cuda_available()):
        raise ValueError(
            "--quantization gguf runs on CPU only (its kernels are CPU kernels): add --device cpu"
        )
    if tp_size > 1:
        raise ValueError("--quantization gguf runs with --tp-size 1 (GGUF rows are not sharded)")
    if load_format == "dummy":
        raise ValueError("--quantization gguf reads the GGUF's weights: drop --load-format dummy")
    if enable_lora:
        raise ValueError("--enable-lora with --quantization gguf is not built (float weights only)")
