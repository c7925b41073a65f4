"""The FP8 checkpoint formats kvflow reads, one parser each (registered in
:data:`~kvflow.runtime.layers.quantization.config.QUANT_FORMATS` by ``quant_method``).

Tensor names inside a quantized layer follow the checkpoints: ``weight``
(``float8_e4m3fn``), the weight scales (``weight_scale``, or ``weight_scale_inv`` for
block scales in the Hugging Face ``fp8`` format) and, for static activations,
``input_scale``. Every parser raises ValueError (one line) for a flavour it does not serve.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from typing import Any

from kvflow.runtime.layers.quantization.config import Fp8Scheme, QuantConfig

__all__ = ["parse_compressed_tensors", "parse_hf_fp8", "parse_modelopt"]


def _substring(name: str) -> str:
    return f".*{re.escape(name)}.*"


def parse_hf_fp8(config: Mapping[str, Any]) -> QuantConfig:
    """Hugging Face ``quant_method: fp8``: with ``weight_block_size`` the block format of
    DeepSeek-V3 and Qwen3's FP8 releases (``weight_scale_inv`` per 128x128 block, dynamic
    per-token-group activations); without it, per-tensor ``weight_scale`` and, for
    ``activation_scheme: static``, a per-tensor ``input_scale``. ``modules_to_not_convert``
    (or ``ignored_layers``) name modules left in the float dtype, by substring."""
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoint with fmt {fmt!r}: kvflow serves e4m3 weights only")
    activation = config.get("activation_scheme", "dynamic")
    if activation not in ("static", "dynamic"):
        raise ValueError(f"fp8 checkpoint with activation_scheme {activation!r} is not served")
    ignored = [*(config.get("modules_to_not_convert") or ()), *(config.get("ignored_layers") or ())]
    ignore = tuple(_substring(name) for name in ignored)
    block = config.get("weight_block_size")
    if block is None:
        scheme = Fp8Scheme(weight="tensor", static_input=activation == "static")
        return QuantConfig("fp8", scheme, ignore)
    if len(block) != 2 or activation != "dynamic":
        raise ValueError(
            f"fp8 checkpoint with weight_block_size {block} and activation_scheme "
            f"{activation!r}: block scales are served with dynamic activations, 2-D blocks"
        )
    scheme = Fp8Scheme(
        weight="block", block_size=(int(block[0]), int(block[1])), scale_name="weight_scale_inv"
    )
    return QuantConfig("fp8", scheme, ignore)


def _ct_pattern(name: str) -> str:
    # compressed-tensors: "re:<regex>" matched from the start, else an exact module name
    return f"(?:{name[3:]}).*" if name.startswith("re:") else re.escape(name)


def _ct_float8(args: Mapping[str, Any] | None, what: str) -> Mapping[str, Any]:
    if not args or args.get("type") != "float" or args.get("num_bits") != 8:
        raise ValueError(
            f"compressed-tensors {what} {dict(args) if args else None}: kvflow serves 8-bit "
            "float weights with 8-bit float activations (FP8 W8A8)"
        )
    if not args.get("symmetric", True):
        raise ValueError(f"compressed-tensors asymmetric FP8 {what} are not served")
    return args


def parse_compressed_tensors(config: Mapping[str, Any]) -> QuantConfig:
    """compressed-tensors (llm-compressor: NeuralMagic/RedHat FP8 checkpoints), format
    ``float-quantized``: one scheme for every ``Linear`` (all config groups alike), weight
    strategy ``tensor``, ``channel`` or ``block``; activations dynamic (per token; per
    group for block weights) or static per tensor (``input_scale``). ``ignore``: exact
    module names or ``re:`` patterns."""
    fmt = config.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r}: kvflow serves float-quantized")
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("compressed-tensors checkpoint without config_groups")
    schemes = set()
    for group in groups:
        if list(group.get("targets") or []) != ["Linear"]:
            raise ValueError(
                f"compressed-tensors targets {group.get('targets')}: kvflow serves one "
                "scheme for every Linear"
            )
        weights = _ct_float8(group.get("weights"), "weights")
        inputs = _ct_float8(group.get("input_activations"), "input activations")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors FP8 weight strategy {strategy!r} is not served")
        static = not inputs.get("dynamic", False)
        if static and inputs.get("strategy") != "tensor":
            raise ValueError(
                f"compressed-tensors static input activations of strategy "
                f"{inputs.get('strategy')!r}: kvflow serves static per-tensor scales"
            )
        block = None
        if strategy == "block":
            structure = list(weights.get("block_structure") or ())
            if len(structure) != 2 or static:
                raise ValueError(
                    "compressed-tensors block FP8 needs a 2-D block_structure and dynamic "
                    "input activations"
                )
            block = (int(structure[0]), int(structure[1]))
        schemes.add(Fp8Scheme(weight=strategy, static_input=static, block_size=block))
    if len(schemes) != 1:
        raise ValueError("compressed-tensors config groups with different FP8 schemes")
    ignore = tuple(_ct_pattern(name) for name in config.get("ignore") or ())
    return QuantConfig("compressed-tensors", schemes.pop(), ignore)


def parse_modelopt(config: Mapping[str, Any]) -> QuantConfig:
    """NVIDIA ModelOpt (TensorRT Model Optimizer) ``quant_algo: FP8``: per-tensor
    ``weight_scale`` and static per-tensor ``input_scale``; ``exclude_modules`` are
    shell-style patterns. The fields may sit under ``quantization`` (its
    ``hf_quant_config.json``). Its FP8 KV cache scales are read by the model loader
    (:class:`~kvflow.runtime.layers.quantization.KVScaleReader`)."""
    fields = {**config, **(config.get("quantization") or {})}
    algo = fields.get("quant_algo")
    if algo != "FP8":
        raise ValueError(f"modelopt quant_algo {algo!r} is not served; kvflow serves FP8")
    ignore = tuple(fnmatch.translate(name) for name in fields.get("exclude_modules") or ())
    scheme = Fp8Scheme(weight="tensor", static_input=True)
    return QuantConfig("modelopt", scheme, ignore)
