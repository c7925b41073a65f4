"""Which request fields kvflow knows, beyond those its request models declare.

A field is *known* when OpenAI or SGLang (0.5.23: ``entrypoints/openai/protocol.py``,
``managers/io_struct.py`` ``GenerateReqInput``, ``sampling/sampling_params.py``) defines it
for that endpoint. A known field that the request model declares is honoured. The others
are either

- :data:`IGNORED`: accepted and dropped on purpose, because they cannot change the answer
  here (each with the reason, which docs/runtime.md repeats), or
- :data:`REFUSED_UNLESS_DEFAULT`: they would change the answer or ask for an output kvflow
  does not produce, so they are accepted only at their default (``null``/``false``...) and
  otherwise refused with a 400 that says so.

A field no one defines is a 400 naming it. A field that a request model declares always
passes here, so declaring a field on the model is how it becomes honoured.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from kvflow.runtime.wire.errors import RequestError

__all__ = [
    "IGNORED",
    "REFUSED_UNLESS_DEFAULT",
    "SAMPLING_ALIASES",
    "check_fields",
    "check_sampling_fields",
]

_MULTIMODAL = "only for image/audio/video inputs, which this text-only server refuses"

# Accepted with any value, no effect: name -> why.
IGNORED: dict[str, str] = {
    "user": "an end-user id for the caller's own records",
    "metadata": "tags for OpenAI's stored completions; kvflow stores nothing",
    "store": "kvflow does not store completions",
    "service_tier": "one tier",
    "safety_identifier": "an end-user id for the caller's own records",
    "prompt_cache_key": "a routing hint; the radix cache shares prefixes on its own",
    "prediction": "predicted outputs only speed up decoding elsewhere",
    "priority": "kvflow's queue has no priorities (order only, never the answer)",
    "custom_labels": "metric labels",
    "data_parallel_rank": "one data-parallel rank",
    "routed_dp_rank": "one data-parallel rank",
    "disagg_prefill_dp_rank": "one data-parallel rank",
    "routing_key": "a router hint",
    "conversation_id": "a router hint",
    "routed_experts_start_len": "only with return_routed_experts (refused)",
    "return_flat_raw_top_logprobs_b64": "only with flat raw top logprobs (refused)",
    "log_metrics": "kvflow always counts every request in /metrics",
    "no_logs": "kvflow does not log request contents",
    "http_worker_ipc": "SGLang-internal",
    "external_trace_header": "no tracing",
    "received_time": "SGLang-internal",
    "decode_tp_size": "informational for SGLang's PD transfer",
    "images_config": _MULTIMODAL,
    "video_config": _MULTIMODAL,
    "mm_processor_kwargs": _MULTIMODAL,
    "max_dynamic_patch": _MULTIMODAL,
    "min_dynamic_patch": _MULTIMODAL,
    "image_max_dynamic_patch": _MULTIMODAL,
    "video_max_dynamic_patch": _MULTIMODAL,
    "use_audio_in_video": _MULTIMODAL,
    "need_wait_for_mm_inputs": _MULTIMODAL,
    "num_items_assigned": _MULTIMODAL,
    "encoder_urls": _MULTIMODAL,
    # sampling parameters
    "stream_interval": "kvflow streams every step's tokens",
    "spaces_between_special_tokens": "fast tokenizers ignore it (as in transformers)",
}

_NOT_PRODUCED = "an output kvflow does not produce"
_CHANGES = "it would change the answer and kvflow does not implement it"

# Accepted only at one of these values (the default first): name -> (values, why).
REFUSED_UNLESS_DEFAULT: dict[str, tuple[tuple[Any, ...], str]] = {
    **{
        name: ((False, None), _NOT_PRODUCED)
        for name in (
            "return_hidden_states",
            "return_routed_experts",
            "return_cached_tokens_details",
            "return_spec_tokens_details",
            "return_prompt_token_ids",
            "return_token_ids",
            "return_meta_info",
            "return_input_ids_in_sglext",
            "return_output_ids_in_sglext",
            "return_sampling_mask",
            "return_flat_raw_output_top_logprobs",
            "return_flat_raw_top_logprobs",
            "return_entropy",
            "return_bytes",
            "return_indexer_topk",
            "background",
        )
    },
    "sampling_logprobs_mode": ((None,), _NOT_PRODUCED),
    "token_ids_logprob": ((None,), _NOT_PRODUCED),
    "multi_item_delimiter_indices": ((None,), _NOT_PRODUCED),
    "token_indices_to_pool": ((None,), _NOT_PRODUCED),
    **{
        name: ((None,), _CHANGES)
        for name in (
            # structured output: the grammar engine declares them on the models when it lands
            "response_format",
            "regex",
            "ebnf",
            "json_schema",
            "structural_tag",
            "logit_bias",
            # everything else that steers generation
            "lora_id",
            "session_id",
            "session_params",
            "custom_logit_processor",
            "custom_params",
            "watermark",
            "thinking",
            "task",
            "verbosity",
            "audio",
            "web_search_options",
            "functions",
            "function_call",
            "suffix",
            "input_ids",
            "input_embeds",
            "image_data",
            "video_data",
            "audio_data",
            "mm_hashes",
            "mm_content_hashes",
            "modalities",
            "positional_embed_overrides",
            "bootstrap_pair_key",
            "require_reasoning",
            "max_thinking_tokens",
            "kv_hints",
            "beam_width",
        )
    },
    "no_stop_trim": ((False, None), _CHANGES),
    "stop_regex": ((None, [], ""), _CHANGES),  # SGLang's frontend always sends []
    "best_of": ((None, 1), _CHANGES),
}

# SGLang's sampling-parameter names that kvflow knows under another name.
SAMPLING_ALIASES = {"sampling_seed": "seed"}

# Fields of each endpoint (beyond those its model declares) that OpenAI or SGLang define.
_CHAT = {
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "prediction", "priority", "custom_labels", "data_parallel_rank", "routed_dp_rank",
    "disagg_prefill_dp_rank", "routed_experts_start_len", "return_flat_raw_top_logprobs_b64",
    "images_config", "video_config", "mm_processor_kwargs", "max_dynamic_patch",
    "min_dynamic_patch", "use_audio_in_video", "return_hidden_states", "return_routed_experts",
    "return_cached_tokens_details", "return_spec_tokens_details", "return_prompt_token_ids",
    "return_token_ids", "return_meta_info", "return_input_ids_in_sglext",
    "return_output_ids_in_sglext", "return_sampling_mask", "sampling_logprobs_mode",
    "return_flat_raw_output_top_logprobs", "response_format", "regex", "ebnf", "logit_bias",
    "session_id", "session_params", "custom_logit_processor", "custom_params",
    "watermark", "stop_regex", "thinking", "task", "verbosity", "audio", "web_search_options",
    "functions", "function_call", "input_ids", "modalities", "no_stop_trim",
}  # fmt: skip
_COMPLETIONS = {
    "user", "priority", "custom_labels", "data_parallel_rank", "routed_dp_rank",
    "disagg_prefill_dp_rank", "routed_experts_start_len", "images_config",
    "mm_processor_kwargs", "return_hidden_states", "return_routed_experts",
    "return_cached_tokens_details", "return_spec_tokens_details", "return_token_ids",
    "response_format", "json_schema", "regex", "ebnf", "logit_bias", "session_id",
    "session_params", "custom_logit_processor", "custom_params", "watermark", "stop_regex",
    "no_stop_trim", "suffix", "best_of", "metadata", "store", "service_tier",
    "safety_identifier", "prompt_cache_key",
}  # fmt: skip
_GENERATE = {
    "session_id", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "watermark", "token_ids_logprob",
    "return_sampling_mask", "sampling_logprobs_mode", "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64",
    "return_routed_experts", "routed_experts_start_len", "return_indexer_topk", "modalities",
    "session_params", "lora_id", "custom_logit_processor",
    "positional_embed_overrides", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "data_parallel_rank", "disagg_prefill_dp_rank", "routing_key", "conversation_id",
    "http_worker_ipc", "require_reasoning", "max_thinking_tokens", "priority", "custom_labels",
    "return_prompt_token_ids", "external_trace_header", "received_time",
    "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch",
    "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "kv_hints",
    "log_metrics", "no_logs", "return_hidden_states", "return_entropy", "return_bytes",
    "background",
}  # fmt: skip
_SAMPLING = {
    "stop_regex", "beam_width", "json_schema", "regex", "ebnf", "structural_tag",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "custom_params", "watermark",
}  # fmt: skip

ENDPOINT_FIELDS: dict[str, frozenset[str]] = {
    "chat": frozenset(_CHAT),
    "completions": frozenset(_COMPLETIONS),
    "generate": frozenset(_GENERATE),
    "sampling_params": frozenset(_SAMPLING),
}


def _check(raw: Mapping[str, Any], declared: Collection[str], endpoint: str, where: str) -> dict:
    known = ENDPOINT_FIELDS[endpoint]
    kept: dict[str, Any] = {}
    for name, value in raw.items():
        if name in declared:
            kept[name] = value
        elif name not in known:
            raise RequestError(
                400, f"unknown field {where}{name!r}: neither OpenAI nor SGLang defines it here"
            )
        elif name in IGNORED:
            continue
        elif name in REFUSED_UNLESS_DEFAULT:
            allowed, why = REFUSED_UNLESS_DEFAULT[name]
            if not any(value is a or (value == a and type(value) is type(a)) for a in allowed):
                raise RequestError(
                    400,
                    f"{where}{name!r} is not supported by kvflow ({why}); "
                    f"leave it out or give {_json(allowed[0])}",
                )
        else:  # pragma: no cover - every known field is in one table (tested)
            raise AssertionError(name)
    return kept


def check_fields(raw: Any, declared: Collection[str], endpoint: str) -> Any:
    """The request body without the ignored fields; 400 on an unknown field or a refused
    field set to a value other than its default. Non-objects pass (the model refuses them)."""
    if not isinstance(raw, Mapping):
        return raw
    return _check(raw, declared, endpoint, "")


def check_sampling_fields(raw: Any, known: Collection[str]) -> Any:
    """``/generate``'s ``sampling_params`` reduced to what :class:`SamplingParams` takes:
    SGLang's aliases renamed, ignored keys dropped, refused ones checked."""
    if not isinstance(raw, Mapping):
        return raw
    renamed: dict[str, Any] = {
        str(k) if k in known else SAMPLING_ALIASES.get(str(k), str(k)): v for k, v in raw.items()
    }
    return _check(renamed, known, "sampling_params", "sampling_params.")


def _json(value: Any) -> str:
    return json.dumps(value)
