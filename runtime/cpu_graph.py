"""CPU decode graphs: a decode step of a plain Llama-shaped model runs from the token ids to
the final norm in one native call (:class:`~kvflow.kernels.cpu.decoder_stack.DecoderStack`),
the CPU counterpart of :mod:`kvflow.runtime.cuda_graph`.

The per-layer Python path issues ~300 small kernel calls a step on SmolLM2 (30 layers of
norms, four matmuls, rotary, KV store, attention), each through the interpreter, torch's
dispatch and a fresh output tensor: several milliseconds of a ~24 ms step on the 2-core
machine, beside ~13 ms of matmuls. The graph makes the same calls from C, in the same
order with the same arguments, so its logits are bit-equal to the path it replaces.

It applies where every piece is the plain one the C sequence mirrors: the shared
:class:`~kvflow.runtime.models.blocks.DecoderLayer` of :class:`Attention` and
:class:`GatedMLP` with :class:`RMSNorm`, unquantized weights packed for the native matmul
(the fused SwiGLU included), the native attention backend over a pool of the model's dtype,
one rank, no LoRA, no captured hidden states (EAGLE targets). Anything else (Qwen3's q/k
norms, Gemma, MoE, GGUF, FP8, ...) keeps the per-layer path. ``KVFLOW_CPU_DECODE_GRAPH=0``
turns it off. The graph holds the addresses of the weights and KV pools, which are fixed
once loaded (as the CUDA graphs' are).
"""

from __future__ import annotations

import torch

from kvflow.kernels.cpu.decoder_stack import DecoderStack, StackLayer, StackShape
from kvflow.runtime.attention import AttentionBackend
from kvflow.runtime.attention.cpu_backend import CpuKernelBackend
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.layers import RMSNorm, VocabParallelEmbedding
from kvflow.runtime.layers.linear import LinearBase
from kvflow.runtime.layers.matmul import NATIVE_MAX_ROWS, PackedWeight
from kvflow.runtime.layers.quantization import UnquantizedLinearMethod
from kvflow.runtime.models.blocks import Attention, DecoderLayer, GatedMLP
from kvflow.runtime.models.causal_lm import CausalLM

__all__ = ["CpuDecodeGraph"]


def _panels(layer: LinearBase, silu_mul: bool, bias: bool = False) -> torch.Tensor | None:
    """The layer's native panels, where they are the plain unquantized ones the graph runs
    (packed for the fused SwiGLU exactly when ``silu_mul``; a bias only where ``bias``)."""
    if type(layer.method) is not UnquantizedLinearMethod or (layer.bias is not None and not bias):
        return None
    packed = layer.__dict__.get("packed_weight")
    if not isinstance(packed, PackedWeight) or packed.silu_mul != silu_mul:
        return None
    return packed.native


def _stack_layer(layer: DecoderLayer, attn: CpuKernelBackend) -> StackLayer | None:
    """``layer`` as the C sequence's layer, or None where it is not the plain one."""
    self_attn, mlp = layer.self_attn, layer.mlp
    if type(self_attn) is not Attention or type(mlp) is not GatedMLP:
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(norm) is not RMSNorm for norm in norms):
        return None
    qkv = _panels(self_attn.qkv_proj, False, bias=True)
    o = _panels(self_attn.o_proj, False)
    gate_up = _panels(mlp.gate_up_proj, True)
    down = _panels(mlp.down_proj, False)
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    layer_id = self_attn.layer_id
    bias = self_attn.qkv_proj.bias
    return StackLayer(
        input_norm=layer.input_layernorm.weight.detach(),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        qkv=qkv,
        o=o,
        gate_up=gate_up,
        down=down,
        qkv_bias=None if bias is None else bias.detach(),
        k_buffer=attn.kv_pool.k_buffer[layer_id],
        v_buffer=attn.kv_pool.v_buffer[layer_id],
        window=attn.window(layer_id),
    )


class CpuDecodeGraph:
    """Runs decode batches of up to :attr:`max_rows` rows of ``model`` in one native call:
    :meth:`replay` returns the logits :meth:`ModelRunner.run_model` would."""

    def __init__(self, model: CausalLM, stack: DecoderStack, max_rows: int | None) -> None:
        self.model, self.stack, self.max_rows = model, stack, max_rows

    @classmethod
    def build(cls, model: torch.nn.Module, attn: AttentionBackend) -> CpuDecodeGraph | None:
        """The graph of a loaded ``model`` over ``attn``'s KV pool, or None where some piece
        is not the plain one the native sequence mirrors (see the module docstring). The
        caller checks what the model does not show: one rank, no LoRA, no EAGLE pool."""
        if not isinstance(model, CausalLM) or model.tp is not None or model._capture:
            return None
        if type(model).forward is not CausalLM.forward or type(model).embed is not CausalLM.embed:
            return None
        embed = model.embed_tokens
        if type(embed) is not VocabParallelEmbedding or type(model.norm) is not RMSNorm:
            return None
        if type(attn) is not CpuKernelBackend or not attn.native or attn.reads_stored_kv:
            return None
        dtype = embed.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16) or attn.model_dtype != dtype:
            return None
        decoder = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
        if len(decoder) != len(model.layers) or not decoder:
            return None
        plain = [_stack_layer(layer, attn) for layer in decoder]
        layers = [layer for layer in plain if layer is not None]
        if len(layers) != len(decoder) or any(w.qkv.dtype != dtype for w in layers):
            return None
        norms = [model.norm]
        norms += [
            n for layer in decoder for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        tables = {id(_rotary_table(layer.self_attn)) for layer in decoder}
        if len({(norm.eps, norm.weight.dtype) for norm in norms}) != 1 or len(tables) != 1:
            return None
        if model.norm.weight.dtype != dtype:
            return None
        self_attn, mlp = decoder[0].self_attn, decoder[0].mlp
        assert isinstance(mlp, GatedMLP)  # _stack_layer checked it
        shape = StackShape(
            hidden=model.config.hidden_size,
            heads=self_attn.num_heads,
            kv_heads=self_attn.num_kv_heads,
            head_dim=self_attn.head_dim,
            intermediate=mlp.gate_up_proj.output_size // 2,
            eps=model.norm.eps,
            scale=attn.scale,
            logit_cap=attn.logit_cap,
        )
        stack = DecoderStack(
            shape,
            layers,
            embed.weight.detach(),
            model.norm.weight.detach(),
            _rotary_table(self_attn),
            attn.req_to_token.req_to_token,
        )
        # float32 weights run oneDNN above NATIVE_MAX_ROWS rows on the per-layer path
        onednn = any(
            getattr(m.__dict__.get("packed_weight"), "onednn", None) is not None
            for m in model.layers.modules()
        )
        return cls(model, stack, NATIVE_MAX_ROWS if onednn else None)

    def can_run(self, fb: ForwardBatch) -> bool:
        return (
            fb.is_decode
            and fb.input_ids.device.type == "cpu"
            and (self.max_rows is None or fb.input_ids.shape[0] <= self.max_rows)
        )

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Last-position logits ``[B, vocab]`` (float32) of a decode batch."""
        hidden = self.stack.run(
            _int64(fb.input_ids),
            _int64(fb.positions),
            _int64(fb.out_cache_loc),
            _int64(fb.req_pool_indices),
            torch.tensor(fb.seq_lens_cpu, dtype=torch.int64),
        )
        return self.model.compute_logits(hidden)


def _rotary_table(self_attn: Attention) -> torch.Tensor:
    table: torch.Tensor = self_attn.rotary.cos_sin_cache  # type: ignore[assignment]
    return table


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()
