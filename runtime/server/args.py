"""``kvflow serve`` arguments: the runtime contract's flags plus every EngineConfig field.

Engine flags are generated from :class:`EngineConfig` (defaults and types come from the
dataclass, help texts from ``engine_flag_help``), so a new engine option is a CLI flag
without edits here. SGLang's launch flags are taken, mapped or refused by the table in
``sglang_flags``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field

from kvflow import contract
from kvflow.runtime.attention import ATTENTION_BACKENDS
from kvflow.runtime.cache.storage import STORAGE_BACKENDS
from kvflow.runtime.config import EngineConfig
from kvflow.runtime.disagg.transport import KV_TRANSPORTS, KVTransferOptions
from kvflow.runtime.disagg.transport.options import KV_TRANSFER_PROTOCOLS, transport_problem
from kvflow.runtime.layers.quantization import (
    KV_CACHE_DTYPE_FLAG_VALUES,
    QUANTIZATION_FLAG_VALUES,
    resolve_quantization,
)
from kvflow.runtime.lora import parse_lora_paths, resolve_target_modules
from kvflow.runtime.scheduler.policy import SCHEDULE_POLICIES
from kvflow.runtime.server.engine_flag_help import ENGINE_FLAG_HELP, DefaultsHelpFormatter
from kvflow.runtime.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from kvflow.runtime.server.sglang_flags import (
    VALUE_RULES,
    add_sglang_flags,
    aliases_of,
    value_type,
)
from kvflow.runtime.speculative import DRAFTERS, check_speculative
from kvflow.runtime.wire.hicache import HICACHE_WRITE_POLICIES
from kvflow.runtime.wire.pair_token import PairTrust

__all__ = ["ServerArgs", "build_parser", "parse_args"]

_CHOICES = {
    "load_format": ["auto", "dummy"],
    "dtype": ["auto", "float32", "bfloat16", "float16"],
    "quantization": list(QUANTIZATION_FLAG_VALUES),
    "kv_cache_dtype": list(KV_CACHE_DTYPE_FLAG_VALUES),
    "device": ["auto", "cpu", "cuda"],
    "schedule_policy": list(SCHEDULE_POLICIES),
    "attention_backend": ["auto", *ATTENTION_BACKENDS.choices()],
    "load_balance_method": ["round_robin", "shortest_queue"],
    "speculative_algorithm": list(DRAFTERS.choices()),
}
# Contract flags that map onto EngineConfig fields of the same name (None: not given).
_CONTRACT_ENGINE_FIELDS = contract.HICACHE_ENGINE_FIELDS


def _contract_defaults() -> dict[str, str]:
    """What a contract flag left out (argparse default None) stands for, for --help."""
    hicache = {
        "--" + name.replace("_", "-"): str(getattr(EngineConfig, name)) or "unset"
        for name in _CONTRACT_ENGINE_FIELDS
    }
    return {
        "--model-path": "the embedded model",
        "--served-model-name": "the model folder's name",
        "--bootstrap-port": str(contract.DEFAULT_BOOTSTRAP_PORT),
        "--kv-transfer-protocol": KVTransferOptions.protocol,
        **hicache,
        "--max-running-requests": str(EngineConfig.max_running_requests),
    }


@dataclass(frozen=True)
class ServerArgs:
    """Everything one ``kvflow serve`` process is started with."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = contract.DEFAULT_API_PORT
    served_model_name: str = ""
    role: str = "unified"
    kv_transfer: KVTransferOptions | None = None  # prefill/decode: how KV moves (None: unified)
    pair_trust: PairTrust | None = None  # decode: the prefills it may contact
    api_key: str | None = None
    watchdog_timeout: float = 300.0  # seconds a busy scheduler may go without a step
    drain_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests
    log_level: str = "info"
    tool_call_parser: str | None = None  # reads tool calls out of chat answers (SGLang's names)
    reasoning_parser: str | None = None  # splits <think> reasoning from chat answers
    chat_template: str | None = None  # a Jinja file that replaces the tokenizer's template
    lora_read_timeout: float = 300.0  # seconds an adapter's files may take to read

    @property
    def model_name(self) -> str:
        from kvflow.runtime.models import EMBEDDED_MODEL_NAME

        if self.served_model_name:
            return self.served_model_name
        if self.engine.model_path:
            return os.path.basename(os.path.normpath(self.engine.model_path))
        return EMBEDDED_MODEL_NAME


def _engine_fields() -> list[dataclasses.Field]:
    """EngineConfig's fields that are ``kvflow serve`` flags (a field whose metadata says
    ``flag: False`` is set by the runtime itself)."""
    return [
        f
        for f in dataclasses.fields(EngineConfig)
        if f.name != "model_path" and f.metadata.get("flag", True)
    ]


def _base_type(tp: object) -> type:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and args:
        return args[0]
    return tp  # type: ignore[return-value]


class _FlagAdder:
    """Adds a flag with SGLang's other names for it and SGLang's names for its values
    (:mod:`kvflow.runtime.server.sglang_flags`), and remembers every name it defined."""

    def __init__(self) -> None:
        self.defined: set[str] = set()

    def __call__(self, group: argparse._ArgumentGroup, flag: str, **kwargs: typing.Any) -> None:
        if flag in VALUE_RULES and kwargs.get("choices"):
            kwargs["type"] = value_type(flag, kwargs["choices"])
        names = [flag, *aliases_of(flag)]
        self.defined.update(names)
        group.add_argument(*names, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: an SGLang flag that is the start of a kvflow flag must not pass
    # as it; SGLang's own names are declared (sglang_flags.SGLANG_FLAGS).
    parser = argparse.ArgumentParser(
        prog="kvflow serve",
        description="Serve a model over an OpenAI-compatible API.",
        formatter_class=DefaultsHelpFormatter,
        allow_abbrev=False,
    )
    add = _FlagAdder()
    contract_group = parser.add_argument_group("runtime contract (what the operator sets)")
    unset = _contract_defaults()
    for flag, text in contract.SERVE_FLAGS.items():
        kwargs: dict = {"help": f"{text} (default: {unset[flag]})" if flag in unset else text}
        if flag == "--port":
            kwargs.update(type=int, default=contract.DEFAULT_API_PORT)
        elif flag == "--host":
            kwargs["default"] = "127.0.0.1"
        elif flag == "--role":
            kwargs.update(choices=contract.ROLES, default="unified")
        elif flag in ("--bootstrap-port", "--max-running-requests"):
            kwargs["type"] = int
        elif flag == "--kv-transfer-protocol":
            kwargs["choices"] = list(KV_TRANSFER_PROTOCOLS)  # default tcp; None: not given
        elif flag == "--hicache-host-memory-gb":
            kwargs["type"] = float
        elif flag == "--hicache-write-policy":
            kwargs["choices"] = list(HICACHE_WRITE_POLICIES)
        elif flag == "--hicache-storage":
            kwargs["choices"] = ["none", *STORAGE_BACKENDS.choices()]
        add(contract_group, flag, **kwargs)
    server = parser.add_argument_group("server")
    add(
        server,
        "--api-key",
        default=os.environ.get(contract.API_KEY_ENV),
        help=f"require this bearer token (default: ${contract.API_KEY_ENV})",
    )
    add(
        server,
        "--watchdog-timeout",
        type=float,
        default=ServerArgs.watchdog_timeout,
        help="seconds a busy scheduler may go without finishing a step before the server "
        "dumps its stacks (at half) and exits",
    )
    add(
        server,
        "--drain-timeout",
        type=float,
        default=ServerArgs.drain_timeout,
        help="seconds SIGTERM waits for in-flight requests before aborting them",
    )
    add(
        server,
        "--log-level",
        default="info",
        help="level of every process's logs: debug, info, warning, error",
    )
    add(
        server,
        "--disagg-timeout",
        type=float,
        help="prefill/decode: seconds a peer may go without progress before its requests "
        f"fail (default {KVTransferOptions.timeout_s:g})",
    )
    add(
        server,
        "--disaggregation-trusted-prefills",
        nargs="+",
        metavar="HOST:PORT",
        help="decode: prefill bootstrap addresses it may contact without the router's "
        f"signature (SGLang's router cannot sign; kvflow's router signs with "
        f"${contract.INTERNAL_KEY_ENV})",
    )
    add(
        server,
        "--disaggregation-transfer-backend",
        choices=KV_TRANSPORTS.choices(),
        help=f"prefill/decode: the KV transport (default {KVTransferOptions.backend})",
    )
    add(
        server,
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS.choices(),
        help="read tool calls out of chat answers in this model family's format "
        "(needed for tools with tool_choice 'auto')",
    )
    add(
        server,
        "--reasoning-parser",
        choices=REASONING_PARSERS.choices(),
        help="send a chat answer's <think>...</think> part as reasoning_content",
    )
    add(
        server,
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template file used by chat completions instead of the "
        "tokenizer's own (unset: the tokenizer's)",
    )
    engine = parser.add_argument_group("engine")
    resolved_types = typing.get_type_hints(EngineConfig)
    for f in _engine_fields():
        flag = "--" + f.name.replace("_", "-")
        if flag in contract.SERVE_FLAGS:
            continue
        base = _base_type(resolved_types[f.name])
        text = ENGINE_FLAG_HELP.get(f.name, "")  # tests/server/test_engine_flag_help.py
        if typing.get_origin(base) is tuple:  # tuple[str, ...]: one or more values
            add(engine, flag, nargs="+", default=f.default, help=text)
        elif base is bool:
            add(engine, flag, action="store_true", default=f.default, help=text)
        else:
            add(
                engine,
                flag,
                type=base,
                default=f.default,
                choices=_CHOICES.get(f.name),
                help=text,
            )
    add_sglang_flags(parser, add.defined)
    return parser


def _check_hicache(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Refuse HiCache settings that cannot work together (parser.error exits 2)."""
    host_gb = ns.hicache_host_memory_gb or 0.0
    if host_gb < 0:
        parser.error("--hicache-host-memory-gb must be >= 0")
    storage = ns.hicache_storage or "none"
    tiered = host_gb > 0
    if not tiered and (storage != "none" or ns.hicache_write_policy):
        parser.error(
            "--hicache-storage and --hicache-write-policy need the host tier: "
            "add --hicache-host-memory-gb > 0"
        )
    if storage != "none" and not ns.hicache_storage_path and storage == "file":
        parser.error("--hicache-storage file needs --hicache-storage-path DIRECTORY")
    if tiered and ns.disable_radix_cache:
        parser.error("HiCache is a tier under the radix cache: drop --disable-radix-cache")
    if tiered and ns.role == "decode":
        parser.error(
            "the decode role keeps no prefix cache (every prompt's KV comes from the "
            "prefill): HiCache belongs on the prefill or unified role"
        )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _kv_transfer(
    parser: argparse.ArgumentParser, ns: argparse.Namespace
) -> KVTransferOptions | None:
    """The prefill's or decode's KV transfer options; on a unified server, the PD flags are
    refused (``--kv-transfer-protocol`` is also the Mooncake store's, so it stays there)."""
    if ns.bootstrap_port is not None and ns.role != "prefill":
        parser.error("--bootstrap-port is the prefill role's endpoint; add --role prefill")
    if ns.role == "unified":
        given = [
            flag
            for flag, value in (
                ("--disagg-timeout", ns.disagg_timeout),
                ("--disaggregation-transfer-backend", ns.disaggregation_transfer_backend),
                (
                    "--kv-transfer-protocol",
                    None if ns.hicache_storage == "mooncake" else ns.kv_transfer_protocol,
                ),
            )
            if value is not None
        ]
        if given:
            parser.error(
                f"{', '.join(given)}: prefill/decode settings; this server runs the unified "
                "role (add --role prefill or --role decode, or drop them)"
            )
        return None
    if ns.disagg_timeout is not None and ns.disagg_timeout <= 0:
        parser.error("--disagg-timeout must be > 0")
    problem = transport_problem(
        ns.disaggregation_transfer_backend or KVTransferOptions.backend,
        ns.kv_transfer_protocol,
        ns.hicache_storage,
        cuda=lambda: ns.device == "cuda" or (ns.device == "auto" and _cuda_available()),
    )
    if problem:
        parser.error(problem)
    defaults = KVTransferOptions()
    return KVTransferOptions(
        backend=ns.disaggregation_transfer_backend or defaults.backend,
        protocol=ns.kv_transfer_protocol or defaults.protocol,
        timeout_s=defaults.timeout_s if ns.disagg_timeout is None else ns.disagg_timeout,
        bootstrap_timeout_s=_bootstrap_timeout(parser, defaults.bootstrap_timeout_s),
        bootstrap_host=ns.host,
        bootstrap_port=(
            contract.DEFAULT_BOOTSTRAP_PORT if ns.bootstrap_port is None else ns.bootstrap_port
        ),
        # the prefill requires it on its bootstrap routes, the decode sends it (read once)
        internal_key=os.environ.get(contract.INTERNAL_KEY_ENV) or None,
    )


def _bootstrap_timeout(parser: argparse.ArgumentParser, default: float) -> float:
    """``$SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (seconds, > 0), SGLang's knob."""
    return _seconds_env(parser, contract.BOOTSTRAP_TIMEOUT_ENV, default)


def _seconds_env(parser: argparse.ArgumentParser, name: str, default: float) -> float:
    """Environment variable ``name`` as seconds > 0 (``default`` where unset); any other
    value is a one-line start-up error."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        parser.error(f"${name} must be seconds > 0, not {raw!r}")
    return value


def _pair_trust(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> PairTrust | None:
    """The decode's rule for the prefills it contacts: the router's signed pairs (with
    ``$KVFLOW_INTERNAL_KEY``) and/or a static list; a decode with neither is refused."""
    trusted = frozenset(ns.disaggregation_trusted_prefills or ())
    if ns.role != "decode":
        if trusted:
            parser.error(
                "--disaggregation-trusted-prefills is the decode role's; add --role decode"
            )
        return None
    for address in trusted:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            parser.error(f"--disaggregation-trusted-prefills {address!r}: expected HOST:PORT")
    trust = PairTrust(key=os.environ.get(contract.INTERNAL_KEY_ENV) or None, trusted=trusted)
    if not trust.configured:
        parser.error(
            "the decode role contacts only trusted prefills: set "
            f"${contract.INTERNAL_KEY_ENV} (the same as its router's) or name them with "
            "--disaggregation-trusted-prefills HOST:PORT ..."
        )
    return trust


def _chat_template(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> str | None:
    """The ``--chat-template`` file, checked: a readable Jinja file (SGLang's built-in
    template names and JSON conversation templates are refused)."""
    path = ns.chat_template
    if path is None:
        return None
    if ns.skip_tokenizer_init:
        parser.error("--chat-template needs the tokenizer: drop --skip-tokenizer-init")
    if not os.path.isfile(os.path.expanduser(path)):
        parser.error(
            f"--chat-template {path}: no such file; kvflow takes a Jinja template file "
            "(SGLang's built-in template names are not built)"
        )
    if path.endswith(".json"):
        parser.error(
            f"--chat-template {path}: SGLang's JSON conversation templates are not built; "
            "give a Jinja template file"
        )
    return path


def _check_quantization(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Refuse a checkpoint's weight format kvflow cannot serve, or a ``--quantization``
    that does not fit it (one line, exit 2), before any process starts. The embedded model
    is a float Llama converted from a GGUF (which ``gguf`` serves); a path that does not
    resolve is left to start-up's own message."""
    from kvflow.runtime.config import ModelConfig
    from kvflow.runtime.layers.quantization.gguf_file import check_gguf_serving
    from kvflow.runtime.models import resolve_model_path
    from kvflow.runtime.models.embedded import embedded_gguf_file, gguf_source

    saved, is_moe, gguf_file = None, False, None  # gguf_file: the GGUF the model came from
    if ns.model_path:
        try:
            folder = resolve_model_path(ns.model_path, ns.load_format)
            config = ModelConfig.from_path(folder)
        except (OSError, ValueError, KeyError):
            return
        saved, is_moe = config.quantization_config, config.num_experts > 0
        source = gguf_source(folder) if folder.is_dir() else None
        gguf_file = None if source is None else str(source)
    elif ns.quantization == "gguf":
        try:
            gguf_file = str(embedded_gguf_file())
        except FileNotFoundError:
            return
    try:
        if ns.quantization == "gguf":
            check_gguf_serving(ns.device, ns.tp_size, ns.load_format, ns.enable_lora)
        resolve_quantization(saved, ns.quantization, is_moe, gguf_file)
    except ValueError as err:
        parser.error(str(err))


def _check_lora(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """SGLang's LoRA flags: valid values, and --enable-lora where they are given."""
    given = ns.lora_paths or ns.lora_target_modules or ns.max_lora_rank
    if not ns.enable_lora:
        if given:
            parser.error(
                "--lora-paths, --max-lora-rank and --lora-target-modules need --enable-lora"
            )
        return
    try:
        parse_lora_paths(ns.lora_paths)
        resolve_target_modules(tuple(ns.lora_target_modules))
    except ValueError as err:
        parser.error(str(err))
    if ns.max_loras_per_batch < 1 or ns.max_lora_rank < 0:
        parser.error("--max-loras-per-batch must be >= 1 and --max-lora-rank >= 0")
    if not ns.lora_paths and not (ns.max_lora_rank and ns.lora_target_modules):
        parser.error(
            "--enable-lora without --lora-paths needs --max-lora-rank and --lora-target-modules "
            "(the adapters loaded later must fit them)"
        )
    if ns.is_embedding:
        parser.error("--enable-lora serves generation: drop --is-embedding")


def _check_embedding(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    if ns.is_embedding and ns.role != "unified":
        parser.error("--is-embedding serves on the unified role only: drop --role")


def parse_args(argv: list[str]) -> ServerArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    kv_transfer = _kv_transfer(parser, ns)
    engine_kwargs = {f.name: getattr(ns, f.name) for f in _engine_fields()}
    for name in _CONTRACT_ENGINE_FIELDS:
        if engine_kwargs[name] is None:
            del engine_kwargs[name]
    _check_hicache(parser, ns)
    _check_embedding(parser, ns)
    _check_quantization(parser, ns)
    _check_lora(parser, ns)
    for name in ("lora_paths", "lora_target_modules"):
        engine_kwargs[name] = tuple(engine_kwargs[name])
    if ns.max_running_requests is not None:
        engine_kwargs["max_running_requests"] = ns.max_running_requests
    else:
        engine_kwargs["max_running_requests"] = EngineConfig.max_running_requests
    engine_cfg = EngineConfig(model_path=ns.model_path or None, **engine_kwargs)
    try:
        check_speculative(engine_cfg, ns.role)
    except ValueError as err:
        parser.error(str(err))
    return ServerArgs(
        engine=engine_cfg,
        host=ns.host,
        port=ns.port,
        served_model_name=ns.served_model_name or "",
        role=ns.role,
        kv_transfer=kv_transfer,
        pair_trust=_pair_trust(parser, ns),
        api_key=ns.api_key or None,
        watchdog_timeout=ns.watchdog_timeout,
        drain_timeout=ns.drain_timeout,
        log_level=ns.log_level,
        tool_call_parser=ns.tool_call_parser,
        reasoning_parser=ns.reasoning_parser,
        chat_template=_chat_template(parser, ns),
        lora_read_timeout=_seconds_env(
            parser, contract.LORA_READ_TIMEOUT_ENV, ServerArgs.lora_read_timeout
        ),
    )
