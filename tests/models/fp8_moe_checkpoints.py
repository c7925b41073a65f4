"""FP8 checkpoints of mixture-of-experts models in each published format, and their
reference: transformers loading the dequantized tensors.

transformers holds a layer's experts fused in memory but saves them per expert, as the
published checkpoints do, so these are written from the saved float checkpoint's tensors
(every decoder projection and every expert's gate, up and down quantized; the routers
stay float, as in the published ones) with the quantizers of ``fp8_checkpoints.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from fp8_checkpoints import (
    FORMATS,
    PART_GAIN,
    _block_dequant,
    _block_quant,
    _channel_quant,
    _ignored,
    _tensor_quant,
)

# Mixtral's w1 and w3 are gate and up: their per-tensor scales differ as Qwen's do
GAIN = {**PART_GAIN, "w1": PART_GAIN["gate_proj"], "w3": PART_GAIN["up_proj"]}
ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.gate\.weight$")


def _projection(name: str, tensor: torch.Tensor) -> bool:
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and tensor.dim() == 2
        and not ROUTER.search(name)
    )


def _quantize(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if scheme == "block":
        q, scale = _block_quant(w, (128, 128))
        return q, scale, _block_dequant(q, scale, (128, 128))
    q, scale = (_channel_quant if scheme == "channel" else _tensor_quant)(w)
    return q, scale, q.float() * scale.reshape(-1, 1)


def write_fp8_moe(src: Path, dst: Path, fmt: str, reference: Path) -> torch.nn.Module:
    """Write the float checkpoint in ``src`` (its projections scaled by ``GAIN``) as an
    ``fmt`` FP8 checkpoint in ``dst`` (``online``: a float checkpoint, to be served with
    ``--quantization fp8``), and the dequantized tensors (per channel for ``online``) as a
    float checkpoint in ``reference``; return transformers' model of ``reference``."""
    import transformers
    from safetensors.torch import load_file, save_file

    online = ({}, "channel", False, "")
    config, scheme, static, scale_name = online if fmt == "online" else FORMATS[fmt]
    saved, dequantized = {}, {}
    g = torch.Generator().manual_seed(7)
    for name, w in load_file(str(src / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        part = module.rpartition(".")[2]
        if not _projection(name, w) or (fmt != "online" and _ignored(fmt, module)):
            saved[name] = dequantized[name] = w.contiguous()
            continue
        w = w * GAIN.get(part, 1.0)
        q, scale, deq = _quantize(w, scheme)
        dequantized[name] = deq
        if fmt == "online":
            saved[name] = w.contiguous()
            continue
        saved[name] = q
        saved[f"{module}.{scale_name}"] = scale.float().contiguous()
        if static:
            saved[f"{module}.input_scale"] = (0.01 + 0.02 * torch.rand(1, generator=g)).reshape(())
        if fmt == "modelopt" and part in ("k_proj", "v_proj"):
            saved[f"{module}.{part[0]}_scale"] = torch.tensor(1.0)
    raw = json.loads((src / "config.json").read_text())
    for folder, tensors in ((dst, saved), (reference, dequantized)):
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(raw))
    if fmt == "modelopt":
        saved_config = {"producer": {"name": "modelopt"}, "quantization": config}
        (dst / "hf_quant_config.json").write_text(json.dumps(saved_config))
    elif fmt != "online":
        (dst / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    return model.eval()
