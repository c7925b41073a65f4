"""A LoRA adapter in host memory, read from PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``) and checked against what this server can apply."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvflow.runtime.lora.targets import LORA_TARGETS

__all__ = ["LoraAdapter", "LoraLimits", "load_adapter"]

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT drops the adapter's
# own name, "default", when it saves; older files keep it)
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class LoraLimits:
    """What the server accepts (``--max-lora-rank``, ``--lora-target-modules``), and the
    base model's shape the adapter must match."""

    max_rank: int
    target_modules: frozenset[str]
    num_layers: int
    in_features: dict[str, int]  # PEFT module -> its input width
    out_features: dict[str, int]  # PEFT module -> its output rows


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter: ``weights[(layer_id, module)] = (A [r, in], B [out, r])`` on the host,
    float32; ``scaling`` (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) multiplies B
    when it is copied to a device slot. ``key`` names its weights' content (the prefix
    cache keys prefixes by it: two adapters' KV of the same tokens never mix)."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    key: str

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.weights)


def _config(folder: Path) -> dict[str, Any]:
    file = folder / "adapter_config.json"
    if not file.exists() or file.is_dir():  # (a regular file, or a pipe streaming one)
        raise ValueError(f"LoRA adapter {folder}: no adapter_config.json (PEFT's format)")
    config: dict[str, Any] = json.loads(file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {folder}: peft_type {config['peft_type']!r} is not LORA")
    unsupported = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (whole trained modules)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
        "lora_bias": "LoRA biases (lora_bias)",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {folder}: {what} is not supported by kvflow")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {folder}: bias {config['bias']!r} is not supported")
    return config


def load_adapter(name: str, path: str, limits: LoraLimits) -> LoraAdapter:
    """Read and check an adapter; raises ValueError saying what is wrong with it."""
    from safetensors.torch import load

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a folder")
    config = _config(folder)
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if not 0 < rank <= limits.max_rank:
        raise ValueError(
            f"LoRA adapter {name!r} has rank {rank}; this server takes ranks up to "
            f"{limits.max_rank} (--max-lora-rank)"
        )
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path}")
    raw = file.read_bytes()
    tensors = load(raw)  # (the bytes read once: they are also the adapter's key)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR.search(tensor_name)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {tensor_name!r} is not supported")
        layer_id, module, half = int(match[1]), match[2], match[3]
        if module not in LORA_TARGETS or module not in limits.target_modules:
            raise ValueError(
                f"LoRA adapter {name!r} targets {module!r}; this server applies adapters to "
                f"{', '.join(sorted(limits.target_modules))} (--lora-target-modules)"
            )
        if layer_id >= limits.num_layers:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer_id} is past the model's")
        halves.setdefault((layer_id, module), {})[half] = tensor.float()
    weights = {}
    for (layer_id, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer_id} {module} lacks A or B")
        a, b = pair["A"], pair["B"]
        want_a = (rank, limits.in_features[module])
        want_b = (limits.out_features[module], rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(
                f"LoRA adapter {name!r}: layer {layer_id} {module} has A {tuple(a.shape)} and "
                f"B {tuple(b.shape)}, expected {want_a} and {want_b} (another base model?)"
            )
        weights[(layer_id, module)] = (a, b)
    if not weights:
        raise ValueError(f"LoRA adapter {name!r}: no LoRA tensors in {file}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    digest = hashlib.sha256(raw)
    digest.update(repr(scaling).encode())
    return LoraAdapter(name, str(folder), rank, scaling, weights, digest.hexdigest()[:24])
