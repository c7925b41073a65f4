"""The decoder stack every family shares: embedding, layers, final norm, LM head, and the
loading of Hugging Face-named tensors into merged projections."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from kvflow.runtime.attention import AttentionBackend
from kvflow.runtime.config import ModelConfig
from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.layers import (
    LINEAR_METHODS,
    CpuMatmul,
    Experts,
    ExpertWeights,
    LinearBase,
    LinearMethod,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    SparseMoE,
    VocabParallelEmbedding,
    gather_logits,
    matmul_weight,
    pack_weight,
)
from kvflow.runtime.layers.quantization import (
    MOE_METHODS,
    KVScaleReader,
    KVScales,
    MoEMethod,
    QuantConfig,
)

__all__ = ["CausalLM"]

ShardId = int | str | tuple[int, int] | None
# an expert's tensor: its weight, or a scale (weight_scale, weight_scale_inv, input_scale)
_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.(weight|\w+_scale(?:_inv)?)$")


class CausalLM(nn.Module, ABC):
    """``forward`` returns hidden states of the new tokens; ``compute_logits`` the logits.

    A family names its decoder layer (:meth:`build_layer`) and how checkpoint tensors map
    onto merged projections (:attr:`stacked_params`). ``linear_method`` (default
    unquantized) goes to every projection of the layers; the LM head stays unquantized.
    With ``tp`` (a :class:`~kvflow.runtime.distributed.TPGroup`), this rank holds its part
    of every layer and of the vocabulary, and loading keeps only that part of each
    checkpoint tensor; the logits are whole on every rank.
    """

    # checkpoint name part -> (our name part, shard id of the merged projection)
    stacked_params: ClassVar[dict[str, tuple[str, int | str]]] = {}
    # checkpoint name part -> ours, applied first (Mixtral's block_sparse_moe is our mlp)
    renamed_parts: ClassVar[dict[str, str]] = {}
    # an expert's checkpoint tensor ``experts.{e}.<name>.weight`` (and its scales) -> (our
    # stacked ExpertWeights, part): Mixtral's w1 -> ("w13", 0), filling shard (e, 0) of
    # experts.w13
    expert_params: ClassVar[dict[str, tuple[str, int]]] = {}

    def __init__(
        self,
        config: ModelConfig,
        linear_method: LinearMethod | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.config, self.tp = config, tp
        self.quant_config: QuantConfig | None = None
        # the checkpoint's FP8 KV cache scales (1.0 where it has none), set by load_weights
        self.kv_scales = KVScales.ones(config.num_layers)
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        # a VocabParallelEmbedding, or a module without the float table (GGUF: read from the
        # tied head's blocks, runtime/layers/quantization/gguf.py)
        self.embed_tokens: nn.Module = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp
        )
        self.layers = nn.ModuleList(
            self.build_layer(i, rotary, linear_method, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.packed_head: CpuMatmul | None = None  # a tied head's, on CPU
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else ParallelLMHead(config.hidden_size, config.vocab_size, tp=tp)
        )
        # EAGLE-3: the layers whose inputs a forward keeps, concatenated, in aux_hidden
        self._capture: frozenset[int] = frozenset()
        self.aux_hidden: torch.Tensor | None = None

    @abstractmethod
    def build_layer(
        self,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None,
        tp: TPGroup | None,
    ) -> nn.Module:
        """One decoder layer: ``(positions, hidden, residual, fb, attn) -> (hidden,
        residual)``, ``residual`` None at the first layer."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``[tokens]`` -> the first layer's input ``[tokens, hidden]``: the embedding rows
        (a family may scale them)."""
        return self.embed_tokens(ids)

    def quantize(self, quant: QuantConfig) -> None:
        """Give every projection of the decoder layers ``quant``'s linear method, and every
        layer's experts its MoE method, except those whose Hugging Face modules ``quant``
        ignores (the LM head and the embedding stay float, and so do the routers, as in
        SGLang); before loading, on ``meta``. A merged projection, or a layer's experts,
        are quantized whole: a checkpoint that ignores some of their parts and not others
        is refused. Layers of one scheme share a method (a GGUF file's layers may differ
        in block type)."""
        self.quant_config = quant
        methods: dict[object, LinearMethod] = {}
        moe_method: MoEMethod | None = None
        routers = {id(m.gate) for m in self.modules() if isinstance(m, SparseMoE)}
        for name, module in self.named_modules():
            if isinstance(module, Experts):
                if not self._ignored(quant, name, self.expert_modules(name, module)):
                    moe_method = moe_method or MOE_METHODS.get(quant.linear_method)(quant.scheme)
                    module.set_method(moe_method)
                continue
            if not isinstance(module, LinearBase) or not name.startswith("layers."):
                continue
            if id(module) in routers or self._ignored(quant, name, self.hf_modules(name)):
                continue
            scheme = quant.scheme_for(self.hf_modules(name))
            if scheme not in methods:
                methods[scheme] = LINEAR_METHODS.get(quant.linear_method)(scheme)
            module.set_method(methods[scheme])

    @staticmethod
    def _ignored(quant: QuantConfig, name: str, hf_modules: list[str]) -> bool:
        ignored = {quant.ignores(hf) for hf in hf_modules}
        if len(ignored) > 1:
            raise ValueError(f"{name}: the checkpoint quantizes some of its parts and not others")
        return ignored.pop()

    def expert_modules(self, name: str, experts: Experts) -> list[str]:
        """The Hugging Face module names of a layer's experts (``experts.{e}.<part>``)."""
        for part, ours in self.renamed_parts.items():
            name = name.replace(f".{ours}.", f".{part}.")
        count = experts.w13.num_experts
        return [f"model.{name}.{e}.{part}" for e in range(count) for part in self.expert_params]

    def hf_modules(self, name: str) -> list[str]:
        """The Hugging Face module names a projection of ours loads (its merged parts)."""
        for part, ours in self.renamed_parts.items():
            name = name.replace(f".{ours}.", f".{part}.")
        merged = [
            name.removesuffix(ours) + part
            for part, (ours, _) in self.stacked_params.items()
            if name.endswith(f".{ours}")
        ]
        return [f"model.{hf}" for hf in merged or [name]]

    def capture_layers(self, layers: Iterable[int]) -> None:
        """From now on each forward also leaves the inputs of ``layers`` (the residual
        stream before each), concatenated in layer order, in :attr:`aux_hidden` ``[N,
        len(layers) * hidden]``: an EAGLE-3 head's features. Families that run their own
        forward cannot."""
        if type(self).forward is not CausalLM.forward:
            raise ValueError(f"{type(self).__name__} cannot give EAGLE-3 its layers' states")
        self._capture = frozenset(layers)

    def forward(self, fb: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        hidden = self.embed(fb.input_ids)
        residual = None
        aux: list[torch.Tensor] = []
        for layer_id, layer in enumerate(self.layers):
            if layer_id in self._capture:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(fb.positions, hidden, residual, fb, attn)
        if aux:
            self.aux_hidden = torch.cat(aux, dim=-1)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[tokens, hidden]`` -> float32 ``[tokens, vocab]``."""
        embed = self.embed_tokens
        if self.lm_head is not None:
            local = self.lm_head(hidden)
        elif isinstance(embed, VocabParallelEmbedding):
            local = matmul_weight(hidden, embed.weight, self.packed_head)
        else:  # the embedding is read from the head's blocks (GGUF): no float weight
            assert self.packed_head is not None, "compute_logits before loading"
            local = self.packed_head.matmul(hidden)
        return gather_logits(local, self.tp, self.config.vocab_size).float()

    def process_weights_after_loading(self, tied_head: CpuMatmul | None = None) -> None:
        """Each projection's method prepares its weights (on CPU: packed copies), and a
        tied head is packed (or is ``tied_head``, one the weight format prepared: the
        GGUF's blocks); run once the weights are loaded."""
        for module in self.modules():
            if isinstance(module, (LinearBase, ExpertWeights)):
                module.process_weights_after_loading()
        embed = self.embed_tokens
        if self.lm_head is None:
            if tied_head is None and isinstance(embed, VocabParallelEmbedding):
                tied_head = pack_weight(embed.weight)
            self.packed_head = tied_head

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the parameters, merged ones shard by shard;
        raises if a tensor has no parameter or a parameter (or shard) gets no tensor, and
        for an FP8 tensor where the layer is not quantized (its scales would be lost). The
        KV cache scales (``k_scale``, ``v_scale``, ``kv_scale``) go to :attr:`kv_scales`."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[tuple[str, ShardId]] = set()
        kv_scales = KVScaleReader(self.config.num_layers)
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or kv_scales.take(name, tensor):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            name, shard_id = self._param_name(name)
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no matching parameter")
            if tensor.element_size() == 1 and params[name].element_size() != 1:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} is {tensor.dtype} but its layer is not "
                    "quantized: the checkpoint's quantization_config does not describe it"
                )
            owner = modules[name.rpartition(".")[0]]
            loader = getattr(owner, "weight_loader", None)  # layers that keep a rank's part
            if loader is not None:
                loader(params[name], tensor, shard_id)
            else:
                params[name].data.copy_(tensor)
            loaded.add((name, shard_id))
        missing = sorted(f"{n}#{s}" if s is not None else n for n, s in self._expected() - loaded)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        self.kv_scales = kv_scales.scales()

    def _param_name(self, name: str) -> tuple[str, ShardId]:
        """Our parameter and shard id for a checkpoint tensor (``model.`` removed)."""
        for part, ours in self.renamed_parts.items():
            name = name.replace(f".{part}.", f".{ours}.")
        expert = _EXPERT.search(name)
        if expert and expert[2] in self.expert_params:
            ours, index = self.expert_params[expert[2]]
            param = f"{name[: expert.start()]}.experts.{ours}.{expert[3]}"
            return param, (int(expert[1]), index)
        for part, (ours, shard) in self.stacked_params.items():
            if f".{part}." in name:
                return name.replace(part, ours), shard
        return name, None

    def _expected(self) -> set[tuple[str, ShardId]]:
        """(parameter, shard id) pairs a checkpoint fills."""
        expected: set[tuple[str, ShardId]] = set()
        for prefix, module in self.named_modules():
            sharded = isinstance(module, (LinearBase, ExpertWeights))
            shards: tuple[ShardId, ...] = module.shard_ids if sharded else (None,)
            for name, _ in module.named_parameters(prefix=prefix, recurse=False):
                expected.update((name, shard) for shard in shards)
        return expected
