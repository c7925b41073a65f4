"""SGLang's common launch flags (``python -m sglang.launch_server``) and what kvflow does with
each: the same flag, another name for a kvflow flag, accepted with no effect, or refused.

One table drives the parser (``args.py``), ``kvflow serve --help`` and the table in
docs/runtime.md (``markdown()``; a test compares them). A flag kvflow cannot honour is
refused at parse time with what to do instead, never accepted and ignored: :class:`NoEffect`
is only for what kvflow always does anyway. Names and meanings follow SGLang's
``python/sglang/srt/server_args.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "SGLANG_FLAGS",
    "VALUE_RULES",
    "Alias",
    "NoEffect",
    "Refuse",
    "Same",
    "ValueRule",
    "add_sglang_flags",
    "aliases_of",
    "markdown",
    "value_type",
]


@dataclass(frozen=True)
class Same:
    """kvflow has the flag under SGLang's name with SGLang's meaning; ``note``: differences."""

    note: str = ""


@dataclass(frozen=True)
class Alias:
    """SGLang's name for the kvflow flag ``target``, with the same meaning."""

    target: str


@dataclass(frozen=True)
class NoEffect:
    """A switch accepted and ignored because kvflow always does what it asks (``reason``)."""

    reason: str


@dataclass(frozen=True)
class Refuse:
    """Refused at parse time (exit 2) with ``alternative``: what kvflow does instead.

    ``nargs`` is SGLang's (0: a switch); ``accepts`` are values kvflow takes with no effect,
    because they ask for what kvflow always does (SGLang's default, mostly).
    """

    alternative: str
    nargs: int | str = 1
    accepts: tuple[str, ...] = ()


@dataclass(frozen=True)
class ValueRule:
    """SGLang's values of a kvflow choice flag: ``aliases`` are kvflow's values under SGLang's
    names; any other value outside kvflow's choices is refused with ``refusal``."""

    refusal: str
    aliases: Mapping[str, str] = field(default_factory=dict)


_NO_HUB = "kvflow loads local folders only (no model hub): download first"

SGLANG_FLAGS: Mapping[str, Same | Alias | NoEffect | Refuse] = {
    # model and tokenizer
    "--model-path": Same("a local folder only (no Hub repo id); unset: the embedded model"),
    "--model": Alias("--model-path"),
    "--tokenizer-path": Same(),
    "--skip-tokenizer-init": Same(),
    "--load-format": Same("auto (safetensors) and dummy"),
    "--context-length": Same(),
    "--trust-remote-code": Refuse(
        "kvflow runs no code from model repositories; it serves the architectures it "
        "implements (Llama, Qwen2, Mistral): drop the flag",
        nargs=0,
    ),
    "--revision": Refuse(f"{_NO_HUB} (hf download REPO --revision REV --local-dir DIR)"),
    "--download-dir": Refuse(
        f"{_NO_HUB} (hf download REPO --local-dir DIR), then --model-path DIR"
    ),
    "--tokenizer-mode": Refuse(
        "kvflow loads transformers' AutoTokenizer (the fast tokenizer where there is one)",
        accepts=("auto",),
    ),
    "--chat-template": Same(
        "a Jinja template file; SGLang's built-in template names and JSON templates are refused"
    ),
    "--json-model-override-args": Refuse("edit the model folder's config.json instead"),
    "--is-embedding": Same(
        "decoder families only; last-token or mean pooling (the folder's sentence-transformers "
        "config), L2-normalised; /v1/embeddings and /encode"
    ),
    # data types and quantization
    "--dtype": Same("auto: float32 on CPU, the checkpoint's dtype on CUDA"),
    "--quantization": Same(
        "fp8 (an FP8 checkpoint, or a float one quantized per channel at load), "
        "compressed-tensors, modelopt, gguf (CPU: the embedded model from its GGUF's own "
        "Q4_1/Q8_0 blocks); unset: the checkpoint's quantization_config "
        "(docs/quantization.md)"
    ),
    "--kv-cache-dtype": Same(
        "auto | fp8_e4m3 | fp8_e5m2 | bf16 | bfloat16; FP8 with the checkpoint's per-layer "
        "k_scale/v_scale (else 1.0); auto stays the model's dtype even where the checkpoint "
        "declares an FP8 KV cache (docs/quantization.md)"
    ),
    # memory and scheduling
    "--mem-fraction-static": Same(),
    "--max-running-requests": Same(),
    "--max-queued-requests": Same(),
    "--max-total-tokens": Same(),
    "--max-prefill-tokens": Same(),
    "--chunked-prefill-size": Same(),
    "--page-size": Same(),
    "--schedule-policy": Same("lpm | fcfs; kvflow's default is lpm (SGLang's fcfs)"),
    "--disable-radix-cache": Same(),
    "--enable-mixed-chunk": Same(),
    "--disable-overlap-schedule": Refuse(
        "kvflow always builds the next decode step while the GPU runs this one (results "
        "never depend on it); there is no switch",
        nargs=0,
    ),
    "--allow-auto-truncate": Refuse(
        "a prompt over the context length is a 400 naming the limit; truncate it on the client",
        nargs=0,
    ),
    # parallelism
    "--tp-size": Same("a prefill and its decodes run the same size"),
    "--tp": Alias("--tp-size"),
    "--tensor-parallel-size": Alias("--tp-size"),
    "--dp-size": Same("unified role only"),
    "--dp": Alias("--dp-size"),
    "--data-parallel-size": Alias("--dp-size"),
    "--load-balance-method": Same("round_robin | shortest_queue"),
    "--pp-size": Refuse("pipeline parallelism is not built; use --tp-size", accepts=("1",)),
    "--ep-size": Refuse("expert parallelism is not built", accepts=("1",)),
    "--enable-dp-attention": Refuse(
        "DP attention is not built; --dp-size runs whole-model replicas behind one "
        "tokenizer manager",
        nargs=0,
    ),
    "--dist-init-addr": Same("node 0's HOST:PORT where the ranks meet"),
    "--nnodes": Same("tensor parallelism over nodes; unified role, --dp-size 1"),
    "--node-rank": Same(),
    "--base-gpu-id": Refuse("choose the GPUs with CUDA_VISIBLE_DEVICES", accepts=("0",)),
    # device and kernels
    "--device": Same("auto | cpu | cuda"),
    "--random-seed": Alias("--seed"),
    "--attention-backend": Same("auto | triton (CUDA) | cpu | torch"),
    "--disable-cuda-graph": Same(),
    "--cuda-graph-max-bs": Same(),
    "--enable-torch-compile": Refuse(
        "no torch.compile in kvflow; CUDA decode replays CUDA graphs (on by default, "
        "--cuda-graph-max-bs)",
        nargs=0,
    ),
    "--grammar-backend": Refuse("structured output runs on xgrammar only", accepts=("xgrammar",)),
    "--watchdog-timeout": Same(),
    # LoRA and speculative decoding
    "--enable-lora": Same("decode CUDA graphs group rows by adapter, each at its own rank"),
    "--lora-paths": Same("NAME=PATH, PATH or JSON entries; pinned is accepted, no effect"),
    "--max-loras-per-batch": Same("device slots; the base model takes none"),
    "--max-lora-rank": Same(),
    "--lora-target-modules": Same("q/k/v/o_proj, gate/up/down_proj, qkv_proj, gate_up_proj, all"),
    "--lora-backend": Refuse(
        "kvflow's LoRA runs its own kernels on CUDA (cuBLAS matmuls, with the base "
        "projection's GEMM where its weight is plain, and a Triton expand in the decode "
        "graphs; segmented Triton kernels past 2,048 eager rows; torch matmuls on CPU)",
        accepts=("triton",),
    ),
    "--speculative-algorithm": Same(
        "EAGLE | EAGLE3 (Llama heads, chains or trees) | NGRAM | STANDALONE; not with --tp-size > 1, "
        "--dp-size > 1, --enable-lora or --is-embedding; NGRAM, STANDALONE: not --role prefill "
        "(EAGLE, EAGLE3: both PD roles, with the same flags; not --hicache-host-memory-gb); "
        "verify in the decode CUDA graphs, the later draft steps (a tree's frontiers) in the "
        "draft's own"
    ),
    "--speculative-draft-model-path": Same(
        "STANDALONE's draft model (the same vocabulary) or the EAGLE / EAGLE3 head "
        "(LlamaForCausalLMEagle / LlamaForCausalLMEagle3)"
    ),
    "--speculative-num-steps": Same("draft forwards per step (STANDALONE, EAGLE, EAGLE3)"),
    "--speculative-eagle-topk": Same(
        "1: chain drafts; > 1: EAGLE, EAGLE3 tree drafts (page size 1; sampled too)"
    ),
    "--speculative-num-draft-tokens": Same("positions verified per step (last token + drafts)"),
    # HTTP server and API
    "--host": Same(),
    "--port": Same("kvflow's default is 8000 (SGLang's 30000)"),
    "--api-key": Same("also read from $KVFLOW_API_KEY"),
    "--served-model-name": Same(),
    "--tool-call-parser": Same("hermes | llama3 | qwen | qwen25"),
    "--reasoning-parser": Same("deepseek-r1 | qwen3"),
    "--skip-server-warmup": NoEffect("kvflow sends no warm-up request at start"),
    "--enable-cache-report": NoEffect("every usage carries prompt_tokens_details.cached_tokens"),
    "--ssl-certfile": Refuse("kvflow serves plain HTTP; terminate TLS in front (an Ingress)"),
    "--ssl-keyfile": Refuse("kvflow serves plain HTTP; terminate TLS in front (an Ingress)"),
    # logging and metrics
    "--log-level": Same(),
    "--enable-metrics": NoEffect("Prometheus metrics are always served at /metrics"),
    "--log-requests": Refuse(
        "kvflow does not log requests; read /metrics or log in a proxy in front", nargs=0
    ),
    "--show-time-cost": Refuse("kvflow keeps no time marks; read /metrics' histograms", nargs=0),
    # prefill/decode disaggregation
    "--disaggregation-mode": Alias("--role"),
    "--disaggregation-bootstrap-port": Alias("--bootstrap-port"),
    "--disaggregation-transfer-backend": Same(
        "mooncake; kvflow adds cuda_ipc (its own CUDA IPC copy between GPUs of one host)"
    ),
    # hierarchical cache
    "--enable-hierarchical-cache": Refuse(
        "give the host tier's size instead: --hicache-host-memory-gb N (0: off)", nargs=0
    ),
    "--hicache-ratio": Refuse("give the host tier's size: --hicache-host-memory-gb N"),
    "--hicache-size": Refuse("give the host tier's size: --hicache-host-memory-gb N (0: off)"),
    "--hicache-write-policy": Same("write_through | write_back"),
    "--hicache-storage-backend": Alias("--hicache-storage"),
}

_ATTENTION = "not built in kvflow; use triton (CUDA), cpu or torch (CPU), or auto"
VALUE_RULES: Mapping[str, ValueRule] = {
    "--attention-backend": ValueRule(_ATTENTION, {"torch_native": "torch"}),
    "--dtype": ValueRule(
        "kvflow's dtypes are auto, float32, bfloat16, float16",
        {"half": "float16", "float": "float32"},
    ),
    "--device": ValueRule("kvflow runs on cpu or cuda (or auto)"),
    "--load-format": ValueRule(
        "kvflow reads *.safetensors (auto) or makes random weights (dummy)",
        {"safetensors": "auto"},
    ),
    "--schedule-policy": ValueRule("kvflow's policies are lpm and fcfs"),
    "--load-balance-method": ValueRule("kvflow spreads requests round_robin or shortest_queue"),
    "--role": ValueRule("roles are unified, prefill, decode", {"null": "unified"}),
    "--speculative-algorithm": ValueRule("kvflow drafts with EAGLE, EAGLE3, NGRAM or STANDALONE"),
    "--quantization": ValueRule(
        "kvflow serves FP8 weights (fp8, compressed-tensors or modelopt FP8 checkpoints, "
        "or fp8 at load) and, on CPU, gguf (the embedded model's own Q4_1/Q8_0 blocks)"
    ),
    "--kv-cache-dtype": ValueRule(
        "kvflow's KV caches are auto, fp8_e4m3, fp8_e5m2, bfloat16 (MXFP8/FP4 not built)",
        {"bf16": "bfloat16"},
    ),
}


def aliases_of(flag: str) -> list[str]:
    """SGLang's other names for the kvflow flag ``flag``."""
    return [name for name, rule in SGLANG_FLAGS.items() if rule == Alias(flag)]


def value_type(flag: str, choices: Sequence[str]) -> Callable[[str], str]:
    """argparse ``type=`` for ``flag``: SGLang's names become kvflow's values, other values
    outside ``choices`` are refused with the rule's alternative."""
    rule = VALUE_RULES[flag]

    def convert(text: str) -> str:
        value = rule.aliases.get(text, text)
        if value not in choices:
            raise argparse.ArgumentTypeError(f"{text!r}: {rule.refusal}")
        return value

    return convert


class _NoEffect(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        pass  # kvflow always does it


class _Refuse(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, rule: Refuse, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=rule.nargs, **kwargs)
        self.rule = rule

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        given = list(values or [])
        if len(given) == 1 and given[0] in self.rule.accepts:
            return
        shown = " ".join([str(option), *given])
        parser.error(f"{shown}: {self.rule.alternative}")


def add_sglang_flags(parser: argparse.ArgumentParser, defined: set[str]) -> None:
    """SGLang's flags that kvflow accepts with no effect or refuses, in their own group; a
    flag kvflow already defines (``defined``: a new engine option, say) keeps kvflow's
    meaning (a test then asks for the table to say so)."""
    group = parser.add_argument_group(
        "SGLang flags (python -m sglang.launch_server) kvflow accepts with no effect or refuses"
    )
    for flag, rule in SGLANG_FLAGS.items():
        if flag in defined:
            continue
        if isinstance(rule, NoEffect):
            group.add_argument(
                flag,
                action=_NoEffect,
                nargs=0,
                default=argparse.SUPPRESS,
                help=f"no effect: {rule.reason}",
            )
        elif isinstance(rule, Refuse):
            accepted = f" (accepted: {', '.join(rule.accepts)})" if rule.accepts else ""
            group.add_argument(
                flag,
                action=_Refuse,
                rule=rule,
                default=argparse.SUPPRESS,
                metavar="VALUE",
                help=f"refused: {rule.alternative}{accepted}",
            )


def _rows() -> Iterator[tuple[str, str, str]]:
    for flag, rule in SGLANG_FLAGS.items():
        if isinstance(rule, Same):
            yield flag, "supported", rule.note
        elif isinstance(rule, Alias):
            yield flag, f"maps to `{rule.target}`", "same meaning"
        elif isinstance(rule, NoEffect):
            yield flag, "accepted, no effect", rule.reason
        else:
            accepted = f" (accepted: `{'`, `'.join(rule.accepts)}`)" if rule.accepts else ""
            yield flag, f"refused{accepted}", rule.alternative


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare | would end the table cell


def markdown() -> str:
    """The docs/runtime.md tables of SGLang's flags and values (a test compares them)."""
    lines = ["| SGLang flag | kvflow | what kvflow does |", "| --- | --- | --- |"]
    lines += [f"| `{flag}` | {status} | {_cell(text)} |" for flag, status, text in _rows()]
    lines += ["", "| flag | SGLang value -> kvflow value | other values |", "| --- | --- | --- |"]
    for flag, rule in VALUE_RULES.items():
        mapped = ", ".join(f"`{a}` -> `{b}`" for a, b in rule.aliases.items()) or "-"
        lines.append(f"| `{flag}` | {mapped} | refused: {rule.refusal} |")
    return "\n".join(lines) + "\n"
