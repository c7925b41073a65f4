"""Builds a native model from a Hugging Face folder (safetensors) or with dummy weights."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from kvflow.runtime.config import ModelConfig
from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.layers import ExpertWeights, LinearBase, RotaryEmbedding
from kvflow.runtime.layers.quantization import GgufScheme, QuantConfig, resolve_quantization
from kvflow.runtime.models import MODELS
from kvflow.runtime.models.causal_lm import CausalLM
from kvflow.runtime.models.embedded import gguf_source

__all__ = ["load_model"]
logger = logging.getLogger(__name__)


def _safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, handle.get_tensor(name)


def _init_dummy(model: nn.Module, seed: int, device: str) -> None:
    """Small uniform weights (norms and FP8 scales at 1), reproducible for a seed on a given
    device."""
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("_scale", "_scale_inv")):
                param.fill_(1.0)
            elif param.element_size() == 1:  # FP8: drawn in float32, then rounded
                values = torch.empty(param.shape, device=device)
                param.copy_(values.uniform_(-0.02, 0.02, generator=generator))
            else:
                param.uniform_(-0.02, 0.02, generator=generator)


def _materialize(model: nn.Module, device: str, dtype: torch.dtype) -> None:
    """``model.to_empty(device=device)`` then ``model.to(dtype)``, except the parameters a
    linear layer or an experts' projection keeps in their own dtype (its ``param_dtypes``:
    FP8 weights, float32 scales); its ``compute_dtype`` is ``dtype``. Each tensor is allocated once, empty, in its
    final dtype (shared parameters stay shared).

    NOTE: ``to_empty`` runs torch's reference ``empty_like`` on meta tensors, whose first
    use imports sympy and torch.fx (0.5 s), and casting the empty float32 tensors touched
    every page of them (0.9 s for SmolLM2-135M on 2 cores): both were start-up time."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        keep: dict[str, torch.dtype] = {}
        if isinstance(module, (LinearBase, ExpertWeights)):
            keep = module.param_dtypes
            module.compute_dtype = dtype
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                target = dtype if param.is_floating_point() and name not in keep else param.dtype
                tensor = torch.empty(param.shape, dtype=target, device=device)
                made[id(param)] = nn.Parameter(tensor, requires_grad=param.requires_grad)
            setattr(module, name, made[id(param)])
        for name, buffer in list(module.named_buffers(recurse=False)):
            target = dtype if buffer.is_floating_point() else buffer.dtype
            setattr(module, name, torch.empty(buffer.shape, dtype=target, device=device))


def _describe(quant: QuantConfig | None) -> str:
    if quant is None:
        return "float"
    if isinstance(quant.scheme, GgufScheme):
        return f"GGUF {quant.scheme.block_type}"
    return f"{quant.quant_method} FP8 {quant.scheme.weight}"


def load_model(
    path: Path,
    config: ModelConfig,
    load_format: str,
    dtype: torch.dtype,
    device: str,
    seed: int,
    tp: TPGroup | None = None,
    quantization: str | None = None,
) -> CausalLM:
    """Instantiate the registered architecture on ``device``, fill its weights and let its
    layers process them (:meth:`CausalLM.process_weights_after_loading`). With ``tp``, this
    rank's part of them: each rank reads the checkpoint and keeps its part (dummy weights
    are drawn per rank, so they differ from one tp size to another). The weight format
    comes from the checkpoint's ``quantization_config`` and ``quantization`` (SGLang's
    ``--quantization``; :func:`resolve_quantization`); with ``gguf``, weights come from
    the GGUF file the model folder was converted from (:mod:`.gguf_weights`)."""
    model_cls = MODELS.get(config.architecture)
    source = gguf_source(path) if quantization == "gguf" else None
    quant = resolve_quantization(
        config.quantization_config,
        quantization,
        is_moe=config.num_experts > 0,
        gguf_file=None if source is None else str(source),
    )
    if quant is not None and quant.gguf is not None and device != "cpu":
        raise ValueError("--quantization gguf runs on CPU only (its kernels are CPU kernels)")
    with torch.device("meta"):
        model = model_cls(config, tp=tp)
        if quant is not None:
            model.quantize(quant)
    head = None  # a tied head the weight format prepares itself
    gguf = quant.gguf if quant is not None and load_format != "dummy" else None
    if gguf is not None:
        from kvflow.runtime.models import gguf_weights

        # before allocating: the embedding may be read from the head's blocks
        head = gguf_weights.gguf_head(model, gguf, dtype)
    _materialize(model, device, dtype)
    # Buffers built on meta (the RoPE tables: Gemma 3 has two) must be recomputed for real.
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            with torch.device("cpu"):
                module.cos_sin_cache = module.table().to(device)
    if load_format == "dummy":
        _init_dummy(model, seed, device)
    elif gguf is not None:
        model.load_weights(gguf_weights.gguf_weights(model, gguf))
    else:
        model.load_weights(_safetensors(path))
    model.process_weights_after_loading(head)
    weights = _describe(quant)
    logger.info(
        "loaded %s (%s, %s, %s weights) on %s",
        config.architecture,
        load_format,
        dtype,
        weights,
        device,
    )
    return model.eval()
