"""Typed, frozen configuration of the runtime.

``ModelConfig`` is read from a Hugging Face ``config.json``; ``EngineConfig`` holds what a
user chooses. Derived values are properties; "auto" values are resolved once by
:func:`EngineConfig.resolved`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.contract import HiCacheOptions

__all__ = ["DUMMY_CONFIGS", "EngineConfig", "ModelConfig"]

# Shipped configs for ``load_format="dummy"`` (random weights in a real model's shapes).
DUMMY_CONFIGS = {
    name: Path(__file__).parent / "configs" / f"{name}.json"
    for name in (
        "llama-3.1-8b",
        "llama-3.1-70b",
        "qwen3-8b",
        "mistral-7b-v0.3",
        "qwen3-30b-a3b",
        "gemma-2-9b",
        "gemma-3-12b",
    )
}
# Gemma's sliding layers where a config saves no layer_types: every ``pattern``-th layer
# (1-based) attends fully, the others slide (Gemma 2: alternate, Gemma 3: 5 local to 1).
_SLIDING_PATTERNS = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}


def _sliding_layers(raw: dict[str, Any]) -> tuple[int, ...]:
    """The layers that slide their attention over ``sliding_window``, transformers' rules:
    ``layer_types`` where saved (transformers >= 5); else Qwen2/Qwen3's
    ``use_sliding_window``, which slides the layers from ``max_window_layers`` on; else
    (Mistral v0.1) every layer."""
    if not raw.get("sliding_window"):
        return ()
    layers = range(raw["num_hidden_layers"])
    if raw.get("layer_types"):
        return tuple(i for i in layers if raw["layer_types"][i] == "sliding_attention")
    arch = (raw.get("architectures") or [""])[0]
    if arch in _SLIDING_PATTERNS:
        pattern = raw.get("sliding_window_pattern") or _SLIDING_PATTERNS[arch]
        return tuple(i for i in layers if (i + 1) % pattern)
    if "use_sliding_window" in raw:
        if not raw["use_sliding_window"]:
            return ()
        return tuple(i for i in layers if i >= raw.get("max_window_layers", 0))
    return tuple(layers)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder of the supported families (Llama, Qwen2, Qwen3, Mistral,
    Mixtral, Qwen3-MoE, Gemma 2, Gemma 3); :func:`kvflow.runtime.models.check_supported`
    says whether this runtime can serve it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str = "float32"
    # Attention window of the layers in sliding_layers (Mistral v0.1: every layer; Qwen2/3
    # only with use_sliding_window): a query at position p sees keys at (p - window, p].
    # None: every layer attends fully.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # Mixture of experts (Mixtral, Qwen3-MoE); num_experts 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's width (Mixtral: intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    # Qwen-MoE: layers (1-based) at multiples of decoder_sparse_step are sparse, except
    # mlp_only_layers (0-based), which keep a dense MLP of intermediate_size.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # The checkpoint's quantization_config as saved (None: float weights); parsed into a
    # typed QuantConfig by kvflow.runtime.layers.quantization.resolve_quantization.
    quantization_config: dict[str, Any] | None = None
    # Gemma 2/3: the MLP's activation (others: silu); attention scores scaled by
    # query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); tanh soft-capping
    # ``cap * tanh(x / cap)`` of the scaled attention scores and of the final logits (None:
    # none); Gemma 3: the RoPE base of the sliding layers (None: unsaved, transformers'
    # default 10000 applies).
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_base_freq: float | None = None
    # EAGLE-3 draft heads: the head's own vocabulary (None: the target's, through the
    # target's LM head), whether its fc has a bias, and the target layers whose outputs it
    # reads (eagle_config.eagle_aux_hidden_state_layer_ids; None: SGLang's default)
    draft_vocab_size: int | None = None
    fc_bias: bool = False
    eagle_aux_layer_ids: tuple[int, ...] | None = None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer_id: int) -> int | None:
        """Layer ``layer_id``'s attention window, or None for full attention."""
        return self.sliding_window if layer_id in self.sliding_layers else None

    def is_sparse_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` has a mixture of experts (transformers' rule)."""
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling or {}
        return str(scaling.get("rope_type", scaling.get("type", "default")))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if "text_config" in raw and "hidden_size" not in raw:
            raise ValueError(
                f"{arch} is a multimodal checkpoint (a vision tower beside its text model), "
                "which is not supported; kvflow serves text-only decoders (for Gemma 3: "
                "Gemma3ForCausalLM, e.g. gemma-3-1b or gemma-3-270m)"
            )
        heads = raw["num_attention_heads"]
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters; Gemma 3
        # keeps one per layer type, the sliding layers' base being rope_local_base_freq.
        rope_params = dict(raw.get("rope_parameters") or {})
        local_base = raw.get("rope_local_base_freq")
        if "full_attention" in rope_params:
            local_base = rope_params.get("sliding_attention", {}).get("rope_theta", local_base)
            rope_params = dict(rope_params["full_attention"])
        rope = dict(rope_params or raw.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", None) or raw.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        max_positions = raw.get("max_position_embeddings", 4096)
        if rope_type in ("llama3", "yarn"):  # transformers' default for the original length
            rope.setdefault("original_max_position_embeddings", max_positions)
        if rope_type == "yarn" and rope.get("factor"):
            # NOTE: Qwen2.5's long-context recipe adds YaRN to a config whose
            # max_position_embeddings stays the original 32768; the scaled length is
            # original x factor (vLLM's rule), so serve that much.
            scaled = int(rope["original_max_position_embeddings"] * rope["factor"])
            max_positions = max(max_positions, scaled)
        sliding = _sliding_layers(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=max_positions,
            # Qwen2 and Llama configs both carry this; Llama defaults to untied, Gemma tied.
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch.startswith("Gemma"))),
            attention_bias=bool(raw.get("attention_bias", arch.startswith("Qwen2"))),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sliding_window=int(raw["sliding_window"]) if sliding else None,
            sliding_layers=sliding,
            # transformers >= 5 saves Qwen3-MoE's num_experts as num_local_experts
            num_experts=raw.get("num_local_experts") or raw.get("num_experts") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
            moe_intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
            # Mixtral always renormalises; Qwen-MoE configs say (transformers' default: no)
            norm_topk_prob=bool(raw.get("norm_topk_prob", arch.startswith("Mixtral"))),
            decoder_sparse_step=raw.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
            # transformers' defaults where unsaved: Gemma's tanh GELU, everyone else's SiLU
            hidden_act=str(
                raw.get("hidden_activation")
                or raw.get("hidden_act")
                or ("gelu_pytorch_tanh" if arch.startswith("Gemma") else "silu")
            ),
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            rope_local_base_freq=float(local_base) if local_base else None,
            quantization_config=raw.get("quantization_config"),
            draft_vocab_size=raw.get("draft_vocab_size"),
            fc_bias=bool(raw.get("bias", False)),
            eagle_aux_layer_ids=_eagle_aux_layers(raw),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        config = cls.from_dict(json.loads(file.read_text()))
        modelopt = file.parent / "hf_quant_config.json"  # ModelOpt's, beside config.json
        if config.quantization_config is None and modelopt.is_file():
            saved = {"quant_method": "modelopt", **json.loads(modelopt.read_text())}
            config = dataclasses.replace(config, quantization_config=saved)
        generation = file.parent / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id")
            extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
            merged = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
            config = dataclasses.replace(config, eos_token_ids=merged)
        return config


def _eagle_aux_layers(raw: dict[str, Any]) -> tuple[int, ...] | None:
    layer_ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if layer_ids is None else tuple(int(i) for i in layer_ids)


@dataclass(frozen=True)
class EngineConfig:
    """What a user chooses for one engine instance (CLI defaults come from here).

    ``model_path=None`` means the embedded SmolLM2-135M-Instruct. With
    ``load_format="dummy"``, ``model_path`` may also name a shipped config
    (see :data:`DUMMY_CONFIGS`) or a ``config.json``.
    """

    model_path: str | None = None
    load_format: str = "auto"  # auto | dummy
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # SGLang's --quantization: None (the checkpoint's own format, from its config.json),
    # fp8 (an FP8 checkpoint, or a float one quantized per channel at load), or a
    # checkpoint format by name (kvflow.runtime.layers.quantization.QUANTIZATION_FLAG_VALUES)
    quantization: str | None = None
    # SGLang's --kv-cache-dtype: the KV cache's storage type; auto: the model's dtype;
    # fp8_e4m3 / fp8_e5m2: FP8 with per-layer K and V scales from the checkpoint (else 1.0)
    # (kvflow.runtime.layers.quantization.kv_cache)
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    context_length: int | None = None
    skip_tokenizer_init: bool = False
    # A folder holding the tokenizer (SGLang's --tokenizer-path); None: the model's folder.
    # Needed for text with dummy weights from a shipped config, which has no tokenizer.
    tokenizer_path: str | None = None
    # SGLang's --is-embedding: requests are embedded (the prompt's pooled, normalised
    # hidden state, kvflow.runtime.pooling), never generated for.
    is_embedding: bool = False

    # KV memory
    page_size: int = 0  # 0: auto (1 on CPU, 16 on CUDA)
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from mem_fraction
    # CUDA: fraction of the GPU for weights + KV pool; 0.88 is SGLang's default at tp 1.
    mem_fraction_static: float = 0.88
    cpu_kv_cache_gb: float = 1.0  # CPU: KV pool budget when max_total_tokens is unset
    disable_radix_cache: bool = False

    # HiCache (SGLang's names): a host-memory KV tier under the radix cache, and a shared
    # storage tier under that (see kvflow.runtime.cache.hiradix and .storage).
    # The fields and defaults of kvflow.contract.HiCacheOptions (the --hicache-* flags).
    hicache_host_memory_gb: float = HiCacheOptions.host_memory_gb  # 0: no host tier
    hicache_write_policy: str = HiCacheOptions.write_policy
    hicache_storage: str = HiCacheOptions.storage  # a storage backend's name, or "none"
    hicache_storage_path: str = HiCacheOptions.storage_path  # the backend's directory/address
    # Seconds a request may wait for its pages to arrive from storage before it runs with
    # what has arrived (best effort; storage never stalls the scheduler).
    hicache_prefetch_timeout: float = 0.5

    # parallelism (SGLang's names): tp_size ranks shard one model (a process and a device
    # each); dp_size independent groups of tp_size ranks serve behind one tokenizer
    # manager, which spreads requests by load_balance_method. GPUs used: tp_size x dp_size.
    tp_size: int = 1
    dp_size: int = 1
    load_balance_method: str = "round_robin"  # round_robin | shortest_queue
    # One tensor-parallel group over several nodes (SGLang's): node 0 runs the HTTP server
    # and ranks 0 .. tp_size / nnodes - 1, node r the next tp_size / nnodes ranks, all joined
    # at dist_init_addr (HOST:PORT on node 0; unset on one node: a loopback port).
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    # scheduling
    max_running_requests: int = 256
    max_queued_requests: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 0  # 0: auto (2048 on CPU, 8192 on CUDA); -1 disables
    schedule_policy: str = "lpm"
    # Mixed chunked prefill (SGLang's --enable-mixed-chunk): while requests are decoding, a
    # prefill step also runs one decode token of each of them, and takes at most
    # mixed_chunk_size prompt tokens, so running streams keep their pace under arrivals.
    enable_mixed_chunk: bool = False
    # 0: auto (96 on CPU: at 32 clients its ITL p99 stayed within 1.3x the median, see
    # benchmarks/results/mixed-chunk-96.md; chunked_prefill_size on CUDA)
    mixed_chunk_size: int = 0
    # auto: triton on CUDA; on CPU the native kernels (cpu) where they build, else torch
    attention_backend: str = "auto"
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 160
    # LoRA (SGLang's names; kvflow.runtime.lora): adapters in PEFT's format, "NAME=PATH" or
    # "PATH"; max_lora_rank 0 and no target modules: from the start-up adapters. Decode CUDA
    # graphs take the rows grouped by adapter slot as an input (kvflow.runtime.lora.graph).
    enable_lora: bool = False
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 8
    max_lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = ()
    # Speculative decoding (SGLang's names; kvflow.runtime.speculative): NGRAM drafts from
    # the request's own tokens, STANDALONE from a smaller model of the same tokenizer (its
    # own KV pool), EAGLE / EAGLE3 from an EAGLE-1/2 / EAGLE-3 head over the target's
    # hidden states (its own KV pool too); the target verifies the drafts in one forward
    # (decode rows, in the decode CUDA graphs; a chain's draft decode steps in the draft's
    # own, kvflow.runtime.speculative.draft_graphs). num_draft_tokens
    # counts the verified positions (the last real token plus num_draft_tokens - 1
    # drafts); 0: num_steps + 1. num_steps 0: auto (3). eagle_topk 0: auto (1: chains);
    # EAGLE and EAGLE3 draft trees with eagle_topk > 1 (page_size 1; the target keeps
    # spare req_to_token rows for the nodes, :attr:`spec_tree_rows`).
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int = 0
    speculative_eagle_topk: int = 0
    speculative_num_draft_tokens: int = 0
    # NOTE: not a flag. Set by the PD prefill role (kvflow.runtime.disagg.prefill) under
    # EAGLE / EAGLE3: the target keeps its head's features per KV slot for the decode, which
    # drafts; this engine loads no head, drafts nothing and budgets no draft memory.
    speculative_features_only: bool = dataclasses.field(default=False, metadata={"flag": False})

    # CPU: threads of torch's ops and of the native kernels' pool in the engine's process;
    # 0: auto (every core this process may run on, shared among the tp_size x dp_size
    # ranks). NOTE: the native kernels (every op of a decode step) do not run on OpenMP, whose barrier waits for a descheduled sibling when
    # another busy process shares the cores; their pool waits only for work a running
    # thread has taken (kvflow/kernels/cpu/pool.py). On 2 cores with one busy process,
    # single-stream decode at the auto count went from 0.8 (OpenMP) to 14.7 tok/s, one
    # thread 15.9; idle, 0.96x OpenMP (benchmarks/results/cpu-contention*.md). torch's own
    # ops (oneDNN matmuls of float32 prefill chunks above 128 rows) still run on OpenMP, and
    # on a machine loaded well past its cores --cpu-threads 1 is still faster.
    cpu_threads: int = 0

    @property
    def spec_tree_rows(self) -> int:
        """Spare ``req_to_token`` rows the target keeps for draft trees' nodes (one per
        draft token of every running request; 0 without trees)."""
        if (
            self.speculative_algorithm is None
            or self.speculative_eagle_topk <= 1
            or self.speculative_features_only
        ):
            return 0
        return self.max_running_requests * max(self.speculative_num_draft_tokens - 1, 0)

    def resolved(self) -> EngineConfig:
        """Resolve every "auto" value once, for the machine this runs on."""
        device = self.device
        if device == "auto":
            device = "cuda" if _cuda_available() else "cpu"
        on_cuda = device.startswith("cuda")
        # a draft tree's rejected branches give back single slots: pages of one token
        tree = self.speculative_algorithm is not None and self.speculative_eagle_topk > 1
        page_size = self.page_size or (16 if on_cuda and not tree else 1)
        chunk = self.chunked_prefill_size or (8192 if on_cuda else 2048)
        mixed_chunk = self.mixed_chunk_size or (max(chunk, 1) if on_cuda else 96)
        # every rank of every data-parallel group is a process with its own threads
        # bad sizes are refused at launch; a node runs its share of the ranks
        ranks = max(1, self.tp_size * self.dp_size // max(self.nnodes, 1))
        threads = self.cpu_threads or max(1, _usable_cores() // ranks)
        backend = self.attention_backend
        if backend == "auto":
            backend = "triton" if on_cuda else _cpu_backend()
        spec_steps, spec_topk, spec_draft_tokens = _resolved_speculative(self)
        return dataclasses.replace(
            self,
            device=device,
            page_size=page_size,
            chunked_prefill_size=chunk,
            mixed_chunk_size=mixed_chunk,
            attention_backend=backend,
            disable_cuda_graph=(self.disable_cuda_graph or not on_cuda),
            speculative_num_steps=spec_steps,
            speculative_eagle_topk=spec_topk,
            speculative_num_draft_tokens=spec_draft_tokens,
            cpu_threads=threads,
        )


def _resolved_speculative(config: EngineConfig) -> tuple[int, int, int]:
    """(num_steps, eagle_topk, num_draft_tokens) with their "auto" (0) values resolved;
    unchanged when speculation is off."""
    if config.speculative_algorithm is None:
        return (
            config.speculative_num_steps,
            config.speculative_eagle_topk,
            config.speculative_num_draft_tokens,
        )
    steps = config.speculative_num_steps or 3
    draft_tokens = config.speculative_num_draft_tokens or steps + 1
    return steps, config.speculative_eagle_topk or 1, draft_tokens


def _cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch (1-2 s of a CPU server's
    start) where no GPU device node shows: torch finds no GPU there either."""
    if not any(os.path.exists(node) for node in _GPU_DEVICE_NODES):
        return False
    import torch

    return bool(torch.cuda.is_available())


# NVIDIA's driver, WSL's GPU paravirtualization, ROCm's (torch.cuda on AMD GPUs)
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def _cpu_backend() -> str:
    """``cpu`` when the native CPU kernels are on and build here, else ``torch``."""
    from kvflow.kernels import cpu

    return "cpu" if cpu.available() else "torch"


def _usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
