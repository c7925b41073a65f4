"""Loads the model and owns the device state: weights, KV pools, attention backend, sampler."""

from __future__ import annotations

import ctypes
import logging
from contextlib import AbstractContextManager, nullcontext, suppress

import torch

from kvflow.runtime.attention import ATTENTION_BACKENDS
from kvflow.runtime.config import EngineConfig, ModelConfig
from kvflow.runtime.cpu_graph import CpuDecodeGraph
from kvflow.runtime.cuda_graph import CudaGraphRunner, GraphAttention
from kvflow.runtime.distributed import ShardedHeads, TPGroup, check_tensor_parallel
from kvflow.runtime.env import cpu_decode_graph
from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.layers.quantization import (
    KVScales,
    check_kv_cache_device,
    kv_cache_torch_dtype,
)
from kvflow.runtime.layers.quantization.unquantized import release_float_weights
from kvflow.runtime.lora import LoraGraphInputs, LoraManager, LoraOptions
from kvflow.runtime.mem import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from kvflow.runtime.models import resolve_model_path, target_features
from kvflow.runtime.models.draft_footprint import draft_footprint
from kvflow.runtime.models.loader import load_model
from kvflow.runtime.pooling import PoolingType, pooling_of
from kvflow.runtime.sampling import Sampler

__all__ = ["ModelRunner"]
logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Extra request rows beyond max_running_requests: the chunked request and requests being
# admitted while others finish.
_EXTRA_ROWS = 8


def _pick_dtype(config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if config.device == "cpu":
        # NOTE: a decode step reads every weight once: bfloat16 halves the bytes (and the
        # KV cache), and on a CPU with native bf16 the kernels run it at full speed. Without
        # it bfloat16 is emulated and slower than float32.
        from kvflow.kernels import cpu

        return torch.bfloat16 if cpu.native_bf16() else torch.float32
    declared = _DTYPES.get(model_config.torch_dtype, torch.bfloat16)
    return torch.bfloat16 if declared == torch.float32 else declared


def _set_cpu_threads(threads: int) -> None:
    """Threads of torch's ops and of the native kernels' own pool (see
    :mod:`kvflow.kernels.cpu.pool`: it waits for no thread that has not started, so a shared
    machine does not stall it)."""
    torch.set_num_threads(threads)
    from kvflow.kernels import cpu

    if cpu.available():
        cpu.pool.set_num_threads(threads)


def _trim_heap() -> None:
    """Give the C heap's free pages back to the kernel (glibc's ``malloc_trim``; a no-op
    elsewhere).

    NOTE: loading frees its staging copies (a layer's GGUF blocks once packed into panels,
    the dequantized float tensors) between allocations that stay, in the middle of the
    heap, where glibc keeps them resident: 24 MB of an idle server's model process
    (SmolLM2, ``--quantization gguf``: 686 -> 662 MB, cpu-peer-gguf-idle.md)."""
    with suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(None).malloc_trim(0)


def _native_step(dtype: torch.dtype, model_config: ModelConfig) -> bool:
    """Whether a CPU step's matmuls all run on the native kernels (bfloat16 at every row
    count, see :mod:`kvflow.runtime.layers.matmul`; dense models: MoE experts run torch)."""
    from kvflow.kernels import cpu

    return dtype == torch.bfloat16 and model_config.num_experts == 0 and cpu.available()


class ModelRunner:
    """``forward(fb)`` runs the model on a batch and returns last-position logits ``[B, vocab]``.

    Under tensor parallelism (``tp``, with ``config.tp_size`` ranks) this rank holds its
    part of the weights and the KV of its key/value heads; the KV pool has the same number
    of pages on every rank, and the logits and sampled ids are the same on every rank.
    """

    def __init__(
        self, config: EngineConfig, tp: TPGroup | None = None, spare_rows: int | None = None
    ) -> None:
        """``spare_rows``: rows of ``req_to_token`` kept for draft trees (None: the target's,
        ``config.spec_tree_rows``)."""
        assert config.device != "auto", "pass EngineConfig.resolved()"
        if (tp.size if tp else 1) != config.tp_size:
            raise ValueError(f"tp_size {config.tp_size} needs a group of that many ranks")
        self.config = config
        self.tp = tp
        self.device = config.device
        torch.manual_seed(config.seed)
        if self.device == "cpu":
            _set_cpu_threads(config.cpu_threads)
        self.model_path = resolve_model_path(config.model_path, config.load_format)
        self.model_config = ModelConfig.from_path(self.model_path)
        # an embedding server's pooling, from the model folder (None: a generation server)
        self.pooling: PoolingType | None = None
        if config.is_embedding:
            folder = self.model_path if self.model_path.is_dir() else self.model_path.parent
            self.pooling = pooling_of(folder)
        mc = self.model_config
        check_tensor_parallel(mc, config.tp_size)
        self.heads = ShardedHeads.of(
            mc.num_heads, mc.num_kv_heads, tp.rank if tp else 0, config.tp_size
        )
        self.dtype = _pick_dtype(config, mc)
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        check_kv_cache_device(config.kv_cache_dtype, self.device)
        self.model = load_model(
            self.model_path,
            mc,
            config.load_format,
            self.dtype,
            self.device,
            config.seed,
            tp,
            config.quantization,
        )
        if self.device == "cpu" and _native_step(self.dtype, mc):
            # NOTE: every matmul and attention of the step runs on the native kernels' pool;
            # torch's own ops left (the logits' cast, argmax, sampling) are small, and an
            # OpenMP team that sleeps between them pays a wake-up per op: up to 11 ms per
            # decode step measured on a loaded 2-core machine, 6 us on one thread.
            torch.set_num_threads(1)
        # LoRA adapters (--enable-lora): their projections wrapped, their host registry
        self.lora: LoraManager | None = None
        if config.enable_lora:
            options = LoraOptions(
                config.lora_paths,
                config.max_loras_per_batch,
                config.max_lora_rank,
                config.lora_target_modules,
            )
            self.lora = LoraManager(self.model, options, self.dtype, self.device)
        self.vocab_size = mc.vocab_size
        self.features = target_features(config, mc)
        if self.features is not None and self.features.layers:
            self.model.capture_layers(self.features.layers)
        self.context_len = min(
            config.context_length or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.page_size = config.page_size
        # NOTE: before the KV pool, which takes what memory is left (the spare rows of
        # draft trees make the table max_running_requests x draft tokens rows longer)
        self.req_to_token = ReqToTokenPool(
            config.max_running_requests + _EXTRA_ROWS,
            self.context_len + 1,
            self.device,
            config.spec_tree_rows if spare_rows is None else spare_rows,
        )
        num_pages = self._num_kv_pages()
        self.allocator = TokenToKVPoolAllocator(num_pages, self.page_size, self.device)
        self.kv_pool = KVPool(
            (num_pages + 1) * self.page_size,
            mc.num_layers,
            self.heads.num_kv_heads,
            mc.head_dim,
            self.kv_dtype,
            self.device,
            self.model.kv_scales,
        )
        # EAGLE: the hidden states of every token the target ran that its draft head reads,
        # by KV slot (valid wherever the slot's KV is, cached prefixes too)
        self.hidden_pool: torch.Tensor | None = None
        if self.features is not None:
            self.hidden_pool = torch.empty(
                ((num_pages + 1) * self.page_size, self.features.width),
                dtype=self.dtype,
                device=self.device,
            )
        if self.kv_pool.is_fp8 and self.model.kv_scales == KVScales.ones(mc.num_layers):
            logger.warning(
                "FP8 KV cache without k_scale/v_scale in the checkpoint: scales default to "
                "1.0, which may cost accuracy where keys or values exceed the FP8 range"
            )
        backend_cls = ATTENTION_BACKENDS.get(config.attention_backend)
        self.attn = backend_cls(
            self.kv_pool,
            self.req_to_token,
            self.heads.num_heads,
            self.heads.num_kv_heads,
            mc.head_dim,
            mc.attention_scale,
            tuple(mc.layer_window(layer_id) for layer_id in range(mc.num_layers)),
            mc.attn_logit_softcapping,
            self.dtype,
        )
        self.sampler = Sampler(mc.vocab_size, self.device, tp)
        self.graph_runner: CudaGraphRunner | None = None
        if self.device.startswith("cuda") and not config.disable_cuda_graph:
            if not isinstance(self.attn, GraphAttention):
                raise ValueError(
                    "CUDA graphs need the triton attention backend (or --disable-cuda-graph)"
                )
            # rows: a verify step runs each request's speculative_num_draft_tokens tokens
            # as decode rows (kvflow.runtime.speculative.batch.build_decode_batch)
            rows_per_request = max(1, config.speculative_num_draft_tokens)
            max_bs = min(config.cuda_graph_max_bs, config.max_running_requests * rows_per_request)
            extra = [] if self.lora is None else [LoraGraphInputs(self.lora)]
            self.graph_runner = CudaGraphRunner(
                self.run_model, self.attn, self.device, max_bs, extra_inputs=extra
            )
            self.graph_runner.capture()
        # a plain model's CPU decode step in one native call (None: the per-layer path)
        self.cpu_graph: CpuDecodeGraph | None = None
        if (
            self.device == "cpu"
            and self.lora is None
            and self.hidden_pool is None
            and tp is None
            and cpu_decode_graph()
        ):
            self.cpu_graph = CpuDecodeGraph.build(self.model, self.attn)
        logger.info(
            "KV cache: %d tokens in pages of %d (%s)",
            self.allocator.size,
            self.page_size,
            self.kv_dtype,
        )
        if self.device == "cpu":
            if self.lora is None:  # the packed panels serve every CPU row of these
                freed = release_float_weights(self.model)
                logger.debug("released %.1f MB of float weights kept packed", freed / 1e6)
            _trim_heap()

    def _num_kv_pages(self) -> int:
        mc, cfg = self.model_config, self.config
        # a draft model's pool gets as many slots as this one: the budget holds both
        draft = draft_footprint(cfg, self.dtype, self.kv_dtype)
        per_token = (
            KVPool.bytes_per_token(
                mc.num_layers, self.heads.num_kv_heads, mc.head_dim, self.kv_dtype
            )
            + self._feature_bytes()
            + (draft.kv_bytes_per_token if draft else 0)
        )
        if cfg.max_total_tokens:
            tokens = cfg.max_total_tokens
        elif self.device == "cpu":
            tokens = int(cfg.cpu_kv_cache_gb * (1 << 30)) // per_token
        else:
            # NOTE: loading leaves freed blocks (the fp32 weights before the cast) in torch's
            # cache, which mem_get_info counts as used: on H100 with Llama-3.1-8B shapes the
            # pool held 292k tokens without this call, capping the CI workload's running
            # batch near 115 requests.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            budget = free - total * (1 - cfg.mem_fraction_static)
            budget -= draft.weight_bytes if draft else 0  # loaded after this pool
            tokens = int(max(budget, 0)) // per_token
        if self.tp is not None:  # every rank schedules the same pages
            tokens = self.tp.min_int(tokens)
        if tokens < self.page_size * 2:
            raise ValueError(f"KV cache would hold only {tokens} tokens; give it more memory")
        return tokens // self.page_size

    def _feature_bytes(self) -> int:
        """Bytes per KV slot of :attr:`hidden_pool` (0: no pool, not an EAGLE target)."""
        return self.features.width * self.dtype.itemsize if self.features else 0

    def run_model(self, fb: ForwardBatch) -> torch.Tensor:
        """The model on a batch whose attention metadata is ready: last-position logits."""
        with self._adapters(fb):
            hidden = self.model(fb, self.attn)
        if self.hidden_pool is not None:
            aux, self.model.aux_hidden = self.model.aux_hidden, None  # (not held past the step)
            self.hidden_pool[fb.out_cache_loc] = hidden if aux is None else aux
        return self.model.compute_logits(hidden if fb.is_decode else hidden[fb.logits_rows()])

    @torch.inference_mode()
    def prepare(self, fb: ForwardBatch) -> None:
        """Stage a decode batch's CUDA-graph inputs now, queued behind the work in flight,
        so that :meth:`forward` on it only launches the graph. A no-op without graphs."""
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            self.graph_runner.stage(fb)

    def run_hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """The model on a batch whose attention metadata is ready: the hidden states of
        every new token, ``[N, hidden]`` (no logits)."""
        with self._adapters(fb):
            return self.model(fb, self.attn)

    @torch.inference_mode()
    def forward_hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """A batch's hidden states of every new token, ``[N, hidden]`` (the model's output
        before logits: a target's after its final norm, pooled by embeddings; an EAGLE
        head's, read by its drafter, which replays its decode steps in graphs of its own,
        :mod:`kvflow.runtime.speculative.draft_graphs`)."""
        self.attn.init_forward_metadata(fb)
        return self.run_hidden(fb)

    def _adapters(self, fb: ForwardBatch) -> AbstractContextManager[None]:
        """The batch's LoRA adapters for one forward (nothing without --enable-lora)."""
        if self.lora is None:
            if fb.lora_paths:
                raise ValueError("a request names a LoRA adapter; start with --enable-lora")
            return nullcontext()
        return self.lora.active(fb)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
        if self.cpu_graph is not None and self.cpu_graph.can_run(fb):
            return self.cpu_graph.replay(fb)
        self.attn.init_forward_metadata(fb)
        return self.run_model(fb)
