"""FP8 checkpoints written the way each published format stores them, from a tiny float
transformers model, and the same model with the dequantized weights (the reference).

Quantization here is written independently of kvflow's (plain torch, the formats' own
layouts), so a wrong scale layout or name in kvflow fails the comparison.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
PROJ = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.weight$")
# The parts of a merged projection get different magnitudes, so their per-tensor scales
# differ and a scale applied to the wrong part shows.
PART_GAIN = {"q_proj": 0.5, "k_proj": 2.0, "gate_proj": 1.5, "up_proj": 0.75}


def _tensor_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().max() / FP8_MAX
    return (w / scale).to(FP8), scale.reshape(1)


def _channel_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    return (w / scale).to(FP8), scale


def _block_quant(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    bn, bk = block
    scale = torch.empty(-(-rows // bn), -(-cols // bk))
    q = torch.empty(rows, cols, dtype=FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            scale[i, j] = tile.abs().max() / FP8_MAX
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (tile / scale[i, j]).to(FP8)
    return q, scale


def _block_dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = q.shape
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return q.float() * full


# format name -> (quantization_config, weight scheme, static input scale, scale name)
FORMATS: dict[str, tuple[dict[str, Any], str, bool, str]] = {
    "hf-fp8-block": (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [128, 128]},
        "block", False, "weight_scale_inv",
    ),
    "hf-fp8-tensor-static": (
        {"quant_method": "fp8", "activation_scheme": "static"}, "tensor", True, "weight_scale",
    ),
    "ct-channel-dynamic": (
        {"quant_method": "compressed-tensors", "format": "float-quantized",
         "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj"],
         "config_groups": {"group_0": {
             "targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                         "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                   "symmetric": True, "dynamic": True}}}},
        "channel", False, "weight_scale",
    ),
    "ct-tensor-static": (
        {"quant_method": "compressed-tensors", "format": "float-quantized",
         "ignore": ["lm_head"],
         "config_groups": {"group_0": {
             "targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "float", "strategy": "tensor",
                         "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                   "symmetric": True, "dynamic": False}}}},
        "tensor", True, "weight_scale",
    ),
    "modelopt": (
        {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
         "exclude_modules": ["lm_head", "*layers.0.self_attn.o_proj"]},
        "tensor", True, "weight_scale",
    ),
}  # fmt: skip


def _ignored(fmt: str, module: str) -> bool:
    config = FORMATS[fmt][0]
    if fmt == "modelopt":
        return module.endswith("layers.0.self_attn.o_proj")
    return any(
        re.match(pattern[3:], module) if pattern.startswith("re:") else pattern == module
        for pattern in config.get("ignore", ())
    )


def write_fp8(hf: torch.nn.Module, src: Path, dst: Path, fmt: str) -> torch.nn.Module:
    """Write ``hf`` (saved float in ``src``), its projections scaled by ``PART_GAIN``, as an
    ``fmt`` FP8 checkpoint in ``dst``; return ``hf`` with those weights, each quantized
    projection's replaced by its dequantized weight."""
    from safetensors.torch import save_file

    config, scheme, static, scale_name = FORMATS[fmt]
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    g = torch.Generator().manual_seed(7)
    for name, w in state.items():
        match = PROJ.match(name)
        module = name.removesuffix(".weight")
        if match:
            w = state[name] = w * PART_GAIN.get(match[3], 1.0)
        if not match or _ignored(fmt, module):
            tensors[name] = w.contiguous()
            continue
        if scheme == "block":
            q, scale = _block_quant(w, (128, 128))
            deq = _block_dequant(q, scale, (128, 128))
        else:
            q, scale = (_channel_quant if scheme == "channel" else _tensor_quant)(w)
            deq = q.float() * scale.reshape(-1, 1)
        tensors[name] = q
        tensors[f"{module}.{scale_name}"] = scale.float().contiguous()
        if static:  # calibrated per-tensor activation scale (any positive value serves)
            tensors[f"{module}.input_scale"] = (0.01 + 0.02 * torch.rand(1, generator=g)).reshape(
                ()
            )
        if fmt == "modelopt" and match[3] in ("k_proj", "v_proj"):
            tensors[f"{module}.{match[3][0]}_scale"] = torch.tensor(1.0)
        state[name] = deq
    save_file(tensors, str(dst / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    if fmt == "modelopt":  # ModelOpt's own file beside a config.json without the section
        saved = {"producer": {"name": "modelopt"}, "quantization": config}
        (dst / "hf_quant_config.json").write_text(json.dumps(saved))
    else:
        raw["quantization_config"] = config
    (dst / "config.json").write_text(json.dumps(raw))
    hf.load_state_dict(state)
    return hf


def online_reference(hf: torch.nn.Module) -> torch.nn.Module:
    """``hf`` with every decoder projection rounded to FP8 per output channel (what
    ``--quantization fp8`` serves from a float checkpoint)."""
    state = hf.state_dict()
    for name, w in state.items():
        if PROJ.match(name):
            q, scale = _channel_quant(w.float())
            state[name] = q.float() * scale
    hf.load_state_dict(state)
    return hf


def _fake_quant(x: torch.Tensor, group: int, static: torch.Tensor | None) -> torch.Tensor:
    """``x`` rounded to FP8 as the FP8 GEMMs see it: by a static per-tensor scale, or per
    token and group of ``group`` columns (absmax / 448)."""
    rows = x.float().reshape(-1, x.shape[-1])
    if static is not None:
        scale = static
    else:
        grouped = rows.view(rows.shape[0], -1, group)
        scale = grouped.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
        deq = (grouped / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
        return deq.view(x.shape).to(x.dtype)
    deq = (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
    return deq.view(x.shape).to(x.dtype)


_MERGED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
           "up_proj": "gate_up", "o_proj": "o", "down_proj": "down"}  # fmt: skip


def emulate_fp8_activations(hf: torch.nn.Module, dst: Path, fmt: str) -> torch.nn.Module:
    """``hf`` (the dequantized reference of the ``fmt`` checkpoint in ``dst``) with the
    inputs of its quantized projections rounded to FP8 as kvflow's FP8 GEMMs round them:
    per token (group of 128 for block scales), or by the static ``input_scale``, the
    largest of a merged projection's parts (kvflow runs q/k/v and gate/up as one GEMM).
    ``fmt`` ``online``: the float checkpoint in ``dst`` served with ``--quantization fp8``
    (every projection, per token)."""
    from safetensors.torch import load_file

    tensors = load_file(str(dst / "model.safetensors"))
    scheme, static = FORMATS[fmt][1:3] if fmt != "online" else ("channel", False)
    merged_scales: dict[tuple[str, str], torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(".input_scale"):
            layer, _, part = name.removesuffix(".input_scale").rpartition(".")
            key = (layer, _MERGED[part])
            merged_scales[key] = torch.maximum(merged_scales.get(key, tensor), tensor)
    for module_name, module in hf.named_modules():
        match = PROJ.match(module_name + ".weight")
        if not match or f"{module_name}.weight" not in tensors:
            continue
        if fmt != "online" and tensors[f"{module_name}.weight"].dtype != FP8:
            continue  # left unquantized by the checkpoint
        key = (module_name.rpartition(".")[0], _MERGED[match[3]])
        scale = merged_scales[key].float() if static else None
        group = 128 if scheme == "block" else module.in_features

        def hook(mod, args, group=group, scale=scale):
            return (_fake_quant(args[0], group, scale),)

        module.register_forward_pre_hook(hook)
    return hf
