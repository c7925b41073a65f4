"""What a checkpoint's weights are: its ``quantization_config`` (``config.json``), or a
float checkpoint quantized at load (``--quantization fp8``), parsed once into a frozen
:class:`QuantConfig`.

Each checkpoint format is one parser in :data:`QUANT_FORMATS`, keyed by the config's
``quant_method`` (``formats.py``); :func:`resolve_quantization` picks it, checks the
``--quantization`` flag against it and raises ``ValueError`` (one line) for anything that
kvflow cannot serve, so the CLI refuses it before a process starts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvflow.runtime.layers.quantization.gguf_file import GgufScheme, GgufSource, read_gguf_source
from kvflow.runtime.utils import Registry

__all__ = [
    "KV_CACHE_DTYPE_FLAG_VALUES",
    "QUANTIZATION_FLAG_VALUES",
    "QUANT_FORMATS",
    "Fp8Scheme",
    "GgufScheme",
    "GgufSource",
    "QuantConfig",
    "resolve_quantization",
]

WeightScheme = Literal["tensor", "channel", "block"]


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 (``float8_e4m3fn``) weights and how their scales are laid out.

    ``weight``: one scale per tensor (per shard of a merged layer), per output channel, or
    per ``block_size`` = (rows, columns) block. ``static_input``: the checkpoint holds a
    per-tensor ``input_scale`` for the activations; else activations are quantized on the
    fly (per token, or per group of ``block_size[1]`` columns of a token for block scales).
    ``scale_name``: the checkpoint's name of the weight scales (``weight_scale_inv`` in the
    block format of Hugging Face ``fp8``). ``serialized`` False: the checkpoint is float
    and is quantized per output channel at load."""

    weight: WeightScheme
    static_input: bool = False
    block_size: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    serialized: bool = True


@dataclass(frozen=True)
class QuantConfig:
    """The weight format of a model's linear layers. ``quant_method``: the checkpoint's (or
    ``fp8`` for a float checkpoint quantized at load, ``gguf`` for a GGUF file's blocks);
    ``ignore``: full-match regexes of Hugging Face module names left unquantized
    (``model.layers.0.mlp.down_proj``); ``linear_method``: the
    :data:`~kvflow.runtime.layers.quantization.LINEAR_METHODS` entry of the layers;
    ``gguf``: the GGUF file, whose tensors give each layer its own :class:`GgufScheme`
    (``scheme`` is then the file's most common one)."""

    quant_method: str
    scheme: Fp8Scheme | GgufScheme
    ignore: tuple[str, ...] = ()
    linear_method: str = "fp8"
    gguf: GgufSource | None = None

    def ignores(self, module_name: str) -> bool:
        """Whether the Hugging Face module ``module_name`` stays unquantized."""
        return any(re.fullmatch(pattern, module_name) for pattern in self.ignore)

    def scheme_for(self, hf_modules: Sequence[str]) -> Fp8Scheme | GgufScheme:
        """The scheme of a layer that loads these Hugging Face modules (its merged parts);
        ValueError where a GGUF file stores the parts in different block types."""
        if self.gguf is None:
            return self.scheme
        types = {self.gguf.block_type(module) for module in hf_modules}
        if len(types) != 1 or None in types:
            raise ValueError(f"{', '.join(hf_modules)}: GGUF block types {types} in one layer")
        return GgufScheme(str(types.pop()))


# A checkpoint format's parser: its quantization_config -> QuantConfig (ValueError if not
# served).
QUANT_FORMATS: Registry[QuantConfig] = Registry("quantization format")
QUANT_FORMATS.register("fp8", "kvflow.runtime.layers.quantization.formats:parse_hf_fp8")
QUANT_FORMATS.register(
    "compressed-tensors", "kvflow.runtime.layers.quantization.formats:parse_compressed_tensors"
)
QUANT_FORMATS.register("modelopt", "kvflow.runtime.layers.quantization.formats:parse_modelopt")

# --quantization values: fp8 (a float checkpoint quantized at load, or any FP8 checkpoint),
# the checkpoint formats by name (which must then be the checkpoint's), and gguf (a model
# converted from a GGUF file served from that file's quantized blocks, on CPU: gguf_file.py)
QUANTIZATION_FLAG_VALUES = ("fp8", "compressed-tensors", "modelopt", "gguf")
# --kv-cache-dtype values (SGLang's bf16 is an alias of bfloat16, see sglang_flags); their
# storage types are kv_cache.py's
KV_CACHE_DTYPE_FLAG_VALUES = ("auto", "fp8_e4m3", "fp8_e5m2", "bfloat16")
_ONLINE = Fp8Scheme(weight="channel", serialized=False)


def resolve_quantization(
    checkpoint: Mapping[str, Any] | None,
    flag: str | None,
    is_moe: bool = False,
    gguf_file: str | None = None,
) -> QuantConfig | None:
    """The model's weight format from its ``quantization_config`` (``checkpoint``, None for
    a float checkpoint) and the ``--quantization`` value (``flag``); None: unquantized.
    ``gguf_file``: the GGUF the model was converted from, if any (for ``gguf``).

    Raises ValueError for an unknown ``quant_method``, an FP8 flavour kvflow does not
    serve or a flag that contradicts the checkpoint; for ``gguf``, a model without a GGUF
    file, a file the kernels do not serve, or a mixture of experts (``is_moe``: GGUF
    experts have no method; FP8 experts do, ``fp8_moe.py``)."""
    if flag is not None and flag not in QUANTIZATION_FLAG_VALUES:
        raise ValueError(
            f"--quantization {flag}: kvflow serves {', '.join(QUANTIZATION_FLAG_VALUES)}"
        )
    if flag == "gguf":
        if is_moe:
            raise ValueError(
                "--quantization gguf: a mixture-of-experts model's experts are not served "
                "from GGUF blocks; serve it unquantized or from an FP8 checkpoint"
            )
        if checkpoint is not None or gguf_file is None:
            raise ValueError(
                "--quantization gguf: this model has no GGUF file (gguf serves the embedded "
                "model, whose GGUF is known)"
            )
        source = read_gguf_source(gguf_file)
        scheme = GgufScheme(source.common_block_type)
        return QuantConfig("gguf", scheme, linear_method="gguf", gguf=source)
    if checkpoint is None:
        if flag in (None, "fp8"):
            return None if flag is None else QuantConfig("fp8", _ONLINE)
        raise ValueError(
            f"--quantization {flag}: the checkpoint is not quantized; {flag} needs a "
            f"checkpoint saved in that format (or use --quantization fp8 to quantize at load)"
        )
    method = str(checkpoint.get("quant_method", ""))
    if method not in QUANT_FORMATS.choices():
        raise ValueError(
            f"checkpoint quant_method {method!r} is not supported; kvflow serves FP8 "
            f"checkpoints of quant_method {', '.join(QUANT_FORMATS.choices())}"
        )
    if flag not in (None, "fp8", method):
        raise ValueError(
            f"--quantization {flag} contradicts the checkpoint's quant_method {method!r}: "
            "drop the flag"
        )
    return QUANT_FORMATS.get(method)(checkpoint)
