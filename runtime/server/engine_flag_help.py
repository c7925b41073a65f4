"""What each engine flag of ``kvflow serve`` means: one text per :class:`EngineConfig` field.

The flags are generated from the dataclass (``args.py``); their meaning lives here, and the
help formatter appends each default. ``tests/server/test_engine_flag_help.py`` fails when a
field has no text (or a text names no field), so a new option cannot reach ``--help`` bare.
Fields that are runtime-contract flags (``kvflow.contract.SERVE_FLAGS``) take the
contract's text instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

__all__ = ["ENGINE_FLAG_HELP", "DefaultsHelpFormatter"]

ENGINE_FLAG_HELP: Mapping[str, str] = {
    "load_format": "auto: the model folder's *.safetensors; dummy: random weights in the "
    "model's shapes (--model-path may then name a shipped config, e.g. llama-3.1-8b, "
    "or a config.json)",
    "dtype": "weights, activations and (--kv-cache-dtype auto) the KV cache; auto: on CPU bfloat16 where it is native "
    "(AVX512-BF16 or AMX), else float32; on CUDA the "
    "checkpoint's dtype (bfloat16 for a float32 checkpoint)",
    "quantization": "weight format (SGLang's --quantization); unset: the checkpoint's own "
    "(its config.json quantization_config: HF fp8, compressed-tensors or ModelOpt FP8); "
    "fp8: an FP8 checkpoint, or a float one quantized per output channel at load; "
    "gguf (CPU only): the embedded model served from its GGUF's own Q4_1/Q8_0 blocks, "
    "dequantized inside the matmul (docs/quantization.md)",
    "kv_cache_dtype": "KV cache storage (SGLang's --kv-cache-dtype): auto: the model's "
    "dtype; fp8_e4m3 / fp8_e5m2: FP8 with per-layer K and V scales from the checkpoint "
    "(k_scale/v_scale, else 1.0), twice the tokens of bfloat16; bf16/bfloat16 "
    "(docs/quantization.md)",
    "device": "auto: cuda when a GPU is visible, else cpu",
    "seed": "the server's random seed: torch's, dummy weights', and the per-request seed "
    "of sampled requests that name none (derived from it and the request id)",
    "context_length": "longest prompt + output in tokens; unset: the model's "
    "max_position_embeddings (a larger value is capped there)",
    "skip_tokenizer_init": "load no tokenizer: requests give input_ids and get token ids "
    "back (no text, chat or structured output)",
    "tokenizer_path": "a folder holding the tokenizer; unset: the model's folder (needed "
    "for text with dummy weights from a shipped config)",
    "is_embedding": "serve embeddings (/v1/embeddings, /encode): each prompt's final-norm "
    "hidden state pooled (last token, or the mean where the folder's sentence-transformers "
    "config says) and L2-normalised; generation requests get 400",
    "page_size": "tokens per KV cache page; 0: auto (1 on CPU, 16 on CUDA)",
    "max_total_tokens": "KV cache pool size in tokens; unset: from --mem-fraction-static "
    "(CUDA) or --cpu-kv-cache-gb (CPU)",
    "mem_fraction_static": "CUDA: fraction of the GPU's memory for the weights and the KV "
    "cache pool together (the pool takes what the weights leave)",
    "cpu_kv_cache_gb": "CPU: KV cache pool size in GiB when --max-total-tokens is unset "
    "(resident only as tokens are written)",
    "disable_radix_cache": "no prefix cache: every prompt is prefilled in full",
    "hicache_prefetch_timeout": "HiCache: seconds a request waits for its pages from the "
    "shared store before it runs with what has arrived",
    "enable_lora": "serve LoRA adapters (PEFT's format) beside the base model: requests "
    "pick one with lora_path or the OpenAI model field (base:adapter or its name)",
    "lora_paths": "adapters loaded at start, NAME=PATH or PATH (then named PATH); more "
    "come through POST /load_lora_adapter",
    "max_loras_per_batch": "device slots for adapters: the most distinct adapters one "
    "batch runs (least recently used ones are evicted to host memory)",
    "max_lora_rank": "largest adapter rank accepted; 0: the largest of --lora-paths",
    "lora_target_modules": "projections adapters may target: q_proj k_proj v_proj o_proj "
    "gate_proj up_proj down_proj (qkv_proj, gate_up_proj, all); unset: those of --lora-paths",
    "speculative_algorithm": "speculative decoding: NGRAM (drafts from the request's own "
    "prompt and output, no extra model), STANDALONE (a smaller model of the same tokenizer, "
    "--speculative-draft-model-path), EAGLE or EAGLE3 (an EAGLE-1/2 or EAGLE-3 head over the "
    "target's hidden states, --speculative-draft-model-path); unset: off. The verify step "
    "replays the decode CUDA graphs; draft steps run eagerly (docs/speculative.md)",
    "speculative_draft_model_path": "STANDALONE: the draft model's folder (or, with "
    "--load-format dummy, a config); it must share the target's vocabulary. EAGLE, EAGLE3: "
    "the head's folder (LlamaForCausalLMEagle / LlamaForCausalLMEagle3, the target's hidden "
    "and vocabulary sizes)",
    "speculative_num_steps": "STANDALONE, EAGLE, EAGLE3: draft forwards per step; 0: auto (3)",
    "speculative_eagle_topk": "draft branches per step: 1 drafts a chain; K > 1 (EAGLE, "
    "EAGLE3 only) a tree, SGLang's rule: each step expands the K best of the K*K children "
    "of its K frontier nodes, and the num-draft-tokens - 1 best candidates by cumulative "
    "draft probability are verified in one forward; needs --page-size 1 (auto: 1); 0: auto (1)",
    "speculative_num_draft_tokens": "positions the target verifies per step: the last token "
    "plus up to N - 1 drafts (a chain: num_steps + 1; a tree of top-K: at most "
    "K + (num_steps - 1) * K * K + 1); 0: auto (num_steps + 1)",
    "tp_size": "tensor parallelism: ranks (a process and a GPU each) that shard one copy "
    "of the model; a prefill and its decodes run the same size (each rank sends its "
    "KV-head shard to the decode rank of its number)",
    "dp_size": "data parallelism: independent groups of --tp-size ranks behind one "
    "tokenizer manager; GPUs used: tp-size x dp-size; unified role only",
    "nnodes": "nodes one tensor-parallel group spans (--tp-size / --nnodes ranks each); "
    "node 0 serves HTTP, the others only run their ranks",
    "node_rank": "this node's number, 0 .. --nnodes - 1",
    "dist_init_addr": "HOST:PORT where the group's ranks meet (node 0's address; needed "
    "with --nnodes > 1); unset on one node: a free loopback port",
    "load_balance_method": "how requests spread over the --dp-size groups: round_robin "
    "(in turn) or shortest_queue (to the group with the fewest requests)",
    "max_queued_requests": "requests that may wait beyond --max-running-requests; past "
    "that a request gets 503 at once; unset: no bound",
    "max_prefill_tokens": "most prompt tokens one prefill batch takes",
    "chunked_prefill_size": "longest prompt chunk prefilled in one step; 0: auto (2048 on "
    "CPU, 8192 on CUDA); -1: no chunking",
    "schedule_policy": "order of waiting requests: lpm (longest cached prefix first; one "
    "that waited 5 s goes first) or fcfs (arrival order)",
    "enable_mixed_chunk": "while requests decode, a prefill step also runs one decode "
    "token of each, so running streams keep their pace under arrivals",
    "mixed_chunk_size": "with --enable-mixed-chunk: most prompt tokens a mixed step "
    "takes; 0: auto (96 on CPU, --chunked-prefill-size on CUDA)",
    "attention_backend": "auto: triton on CUDA; on CPU the native kernels (cpu) where "
    "they build, else torch",
    "disable_cuda_graph": "CUDA: run decode steps eagerly instead of replaying captured "
    "CUDA graphs (always off on CPU)",
    "cuda_graph_max_bs": "CUDA: largest decode batch captured as a CUDA graph (larger "
    "batches run eagerly)",
    "cpu_threads": "CPU: threads of torch's ops and of the native kernels' pool; 0: every "
    "core this process may run on",
}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends each flag's default to its help (``unset`` for None, ``off`` for a switch),
    unless the text already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if "default" in text:
            return text
        if action.default is None:
            shown = "unset"
        elif action.default is False and action.nargs == 0:
            shown = "off"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"
