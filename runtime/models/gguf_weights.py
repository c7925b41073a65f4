"""A model's weights read straight from a GGUF file (``--quantization gguf``), under the
Hugging Face names :meth:`CausalLM.load_weights` takes.

A projection whose layer runs the GGUF linear method gets the file's rows of blocks as they
are (uint8); every other tensor (norms, an untied head, a token embedding that is not a
tied Q8_0 head's: see :func:`gguf_head`) is dequantized by the ``gguf`` package into
float32. llama.cpp's converter permutes the rows
of ``q_proj`` and ``k_proj`` (its rotary pairs neighbouring lanes, Hugging Face's halves);
the rows are put back as transformers' GGUF loader puts them back
(``LlamaTensorProcessor._reverse_permute_weights``), which on whole rows of blocks is the
same move on bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from kvflow.kernels.cpu import qgemm
from kvflow.runtime.layers.quantization import GgufSource
from kvflow.runtime.layers.quantization.gguf import QuantEmbedding, QuantHead
from kvflow.runtime.layers.quantization.gguf_file import gguf_name, read_tensor
from kvflow.runtime.models.causal_lm import CausalLM

__all__ = ["gguf_head", "gguf_weights"]


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """The rows of a q or k projection back in Hugging Face's order (see the docstring)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def _gguf_name(source: GgufSource, hf_module: str) -> str:
    name = gguf_name(hf_module, source.num_layers)
    if name is None:
        raise KeyError(f"{hf_module} has no GGUF tensor name")
    return f"{name}.weight"


def gguf_weights(model: CausalLM, source: GgufSource) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, tensor)`` for every parameter of ``model`` from the GGUF."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    heads = {"q_proj": model.config.num_heads, "k_proj": model.config.num_kv_heads}
    for module_name, module in model.named_modules():
        param = getattr(module, "weight", None)
        if not isinstance(param, torch.nn.Parameter):
            continue
        hf_modules = ["lm_head"] if module_name == "lm_head" else model.hf_modules(module_name)
        for hf_module in hf_modules:
            type_name, data = read_tensor(source.path, _gguf_name(source, hf_module))
            if param.dtype != torch.uint8:
                data = dequantize(data, GGMLQuantizationType[type_name])
            part = hf_module.rpartition(".")[2]
            if part in heads:
                data = _unpermute(data, heads[part])
            yield f"{hf_module}.weight", torch.from_numpy(np.array(data))


def gguf_head(model: CausalLM, source: GgufSource, dtype: torch.dtype) -> QuantHead | None:
    """A tied head in the token embedding's GGUF blocks, where the kernels serve its type
    (None: untied, or another type, which stays the dequantized embedding). Where rows can
    be read from those blocks (Q8_0), ``model.embed_tokens`` becomes a
    :class:`QuantEmbedding` on them: called before the model's tensors are allocated, the
    float embedding never is."""
    if model.lm_head is not None:
        return None
    block_type, data = read_tensor(source.path, _gguf_name(source, "model.embed_tokens"))
    if not qgemm.supports(block_type, model.config.hidden_size):
        return None
    raw = torch.from_numpy(np.array(data))
    head = QuantHead(qgemm.pack(raw, block_type, dtype))
    if QuantEmbedding.reads(head) and model.tp is None:
        model.embed_tokens = QuantEmbedding(head, dtype)
    return head
