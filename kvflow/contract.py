"""The runtime's command-line contract, shared by the operator and the runtime.

Everything one side needs to know about the other lives here: sub-commands, flag names,
ports, HTTP paths and environment variables. The operator renders pod commands with
:func:`serve_argv` / :func:`router_argv`; the runtime's argument parser declares the same
flags from :data:`SERVE_FLAGS` / :data:`ROUTER_FLAGS`, and a test checks both directions.
:data:`SERVE_RUNTIME_FLAGS` are rendered too but declared by the runtime itself.
This module must stay dependency-free (no torch, no kubernetes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

__all__ = [
    "API_KEY_ENV",
    "API_PORT_NAME",
    "BOOTSTRAP_PORT_ANNOTATION",
    "BOOTSTRAP_PORT_NAME",
    "BOOTSTRAP_TIMEOUT_ENV",
    "DEFAULT_API_PORT",
    "DEFAULT_BOOTSTRAP_PORT",
    "DIST_INIT_PORT",
    "HEALTH_GENERATE_PATH",
    "HEALTH_PATH",
    "HICACHE_ENGINE_FIELDS",
    "HICACHE_FLAGS",
    "INTERNAL_KEY_ENV",
    "KV_TRANSFER_PORT_RANGE",
    "LORA_ADAPTERS_ANNOTATION",
    "LORA_READ_TIMEOUT_ENV",
    "METRICS_PATH",
    "MODEL_CACHE_ENV",
    "MOONCAKE_CONFIG_ENV",
    "MOONCAKE_MASTER_METADATA_PORT",
    "MOONCAKE_MASTER_METRICS_PORT",
    "MOONCAKE_MASTER_RPC_PORT",
    "NO_STORAGE",
    "OPERATOR_HEALTH_PATH",
    "OPERATOR_HEALTH_PORT",
    "OPERATOR_METRICS_PORT",
    "POD_IP_ENV",
    "ROLES",
    "ROLE_LABEL",
    "ROUTER_FLAGS",
    "ROUTER_READINESS_PATH",
    "RUNTIME_CONFIG_DIR",
    "SERVE_FLAGS",
    "SERVE_FLAG_ALIASES",
    "SERVE_RUNTIME_FLAGS",
    "SERVE_SPEC_OWNED_FLAGS",
    "HiCacheOptions",
    "LoraOptions",
    "RouterOptions",
    "ServeOptions",
    "format_lora_adapters",
    "parse_lora_adapters",
    "router_argv",
    "serve_argv",
]

# Ports. The API port carries the OpenAI endpoint, /health and /metrics.
DEFAULT_API_PORT = 8000
DEFAULT_BOOTSTRAP_PORT = 8998  # prefill pods: KV-transfer bootstrap endpoint
# A group over several nodes (--nnodes): where node 0's rank 0 meets the other nodes' ranks
# (--dist-init-addr's port; the collectives then pick their own ports, gloo/NCCL).
DIST_INIT_PORT = 29500
OPERATOR_HEALTH_PORT = 8080
OPERATOR_METRICS_PORT = 8081  # the operator's Prometheus /metrics (autoscaler series)
# KV transfer engine (Mooncake) listening ports, RPC and TCP data, of prefill/decode pods and
# of Mooncake store clients: the runtime has the engine pick them inside this inclusive
# range (its MC_MIN_RPC_PORT / MC_MAX_RPC_PORT settings; it ignores a port given in its local
# hostname), so a NetworkPolicy can open exactly this range between prefill and decode pods.
KV_TRANSFER_PORT_RANGE = (17000, 17999)
# The Mooncake master (shared HiCache store): RPC and HTTP metadata server.
MOONCAKE_MASTER_RPC_PORT = 50051
MOONCAKE_MASTER_METADATA_PORT = 8080
MOONCAKE_MASTER_METRICS_PORT = 9003  # mooncake_master's own default

# HTTP paths served by every runtime pod (and the router).
HEALTH_PATH = "/health"  # cheap liveness/readiness: no model work
HEALTH_GENERATE_PATH = "/health_generate"  # runs one token through the model
METRICS_PATH = "/metrics"  # Prometheus text, SGLang metric names under ``sglang:``
# The router only (sglang-router's name): 200 while it has a healthy worker of every role it
# needs (prefill and decode once it knows a PD worker, else unified), else 503. The
# operator makes it the router pod's readiness probe, so a Ready router pod is the router's
# own report that the deployment can serve.
ROUTER_READINESS_PATH = "/readiness"
OPERATOR_HEALTH_PATH = "/healthz"

# Environment variables.
API_KEY_ENV = "KVFLOW_API_KEY"  # bearer token required by the API when set
# One deployment's internal credential, shared by its router, prefills and decodes and never
# given to clients: the bearer token of the prefill's bootstrap routes, the key of the PD
# pair tokens the router signs (``bootstrap_token``), and the router's admin credential.
INTERNAL_KEY_ENV = "KVFLOW_INTERNAL_KEY"
# SGLang's: seconds a prefill waits for the two halves of a room to meet (the decode's
# claim of a prefilled prompt, or the prefill request of a claimed room); default 300.
BOOTSTRAP_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
# seconds a /load_lora_adapter's read of the adapter's files may take before the load is
# refused (default 300; the read runs off the scheduler's loop)
LORA_READ_TIMEOUT_ENV = "KVFLOW_LORA_READ_TIMEOUT_S"
MODEL_CACHE_ENV = "KVFLOW_CACHE_DIR"  # where converted/embedded models are cached
POD_IP_ENV = "KVFLOW_POD_IP"  # the pod's own IP: advertised to KV-transfer peers
# Path of a JSON file with the Mooncake store client settings (keys as SGLang's
# mooncake_store config: local_hostname, metadata_server, global_segment_size,
# local_buffer_size, protocol, device_name, master_server_address); read when
# --hicache-storage is mooncake. An empty local_hostname means "use $KVFLOW_POD_IP".
MOONCAKE_CONFIG_ENV = "KVFLOW_MOONCAKE_CONFIG"

# The ``--hicache-storage`` value meaning "no shared store" (the others name backends).
NO_STORAGE = "none"

# Files. The operator mounts its ConfigMap here: mooncake.json (read through
# MOONCAKE_CONFIG_ENV) and runtime.json (for people; no process reads it).
RUNTIME_CONFIG_DIR = "/etc/kvflow"

ROLES = ("unified", "prefill", "decode")

# Worker pod metadata, as the operator renders it and the router's Kubernetes discovery
# reads it: the role label, the named container ports, the prefill's bootstrap port.
ROLE_LABEL = "kvflow.dev/role"  # a ROLES value on worker pods; other components differ
API_PORT_NAME = "http"  # container port carrying DEFAULT_API_PORT's traffic
BOOTSTRAP_PORT_NAME = "bootstrap"  # prefill pods' KV bootstrap container port
BOOTSTRAP_PORT_ANNOTATION = "kvflow.dev/bootstrap-port"  # prefill pods, decimal
# Worker pods of a deployment with ``spec.lora``: the LoRA adapters the router keeps loaded
# on that pod, as :func:`format_lora_adapters` writes them (the operator annotates each
# running pod, so a list change reaches the pods without a new pod template).
LORA_ADAPTERS_ANNOTATION = "kvflow.dev/lora-adapters"

# Flag name -> help text. The runtime's parser adds exactly these (plus runtime-only tuning
# flags); the operator only ever emits these.
ROUTER_FLAGS: Mapping[str, str] = {
    "--host": "address to bind",
    "--port": "API port",
    "--policy": "round_robin | power_of_two | cache_aware",
    "--worker-urls": "comma-separated unified worker URLs",
    "--prefill-urls": "comma-separated prefill worker URLs (disaggregated mode)",
    "--decode-urls": "comma-separated decode worker URLs (disaggregated mode)",
    "--discover-namespace": "discover workers in this Kubernetes namespace; unset, with a selector: "
    "the router pod's own",
    "--discover-selector": "label selector of the workers to discover",
    "--lora-adapters": "LoRA adapters to keep loaded on every static worker, comma-separated "
    "NAME=PATH (discovered workers: their pods' kvflow.dev/lora-adapters annotation)",
}


def format_lora_adapters(adapters: Mapping[str, str]) -> str:
    """``NAME=PATH,...`` sorted by name: the router flag's and the pod annotation's value."""
    for name, path in adapters.items():
        if not name or any(c in name for c in ",=:") or not path or "," in path:
            raise ValueError(f"LoRA adapter {name!r}={path!r}: no ',' '=' ':' in names, no ','")
    return ",".join(f"{name}={adapters[name]}" for name in sorted(adapters))


def parse_lora_adapters(text: str) -> dict[str, str]:
    """The inverse of :func:`format_lora_adapters`; raises ValueError on a malformed entry."""
    adapters: dict[str, str] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, sep, path = entry.partition("=")
        if not sep or not name or not path or name in adapters:
            raise ValueError(f"LoRA adapter entry {entry!r}: expected NAME=PATH, each name once")
        adapters[name] = path
    return adapters


def _argv(flags: Mapping[str, str], values: Mapping[str, object]) -> list[str]:
    argv: list[str] = []
    for flag, value in values.items():
        if flag not in flags:
            raise ValueError(f"{flag} is not part of the runtime contract")
        if value is None or value == "":
            continue
        argv += [flag, str(value)]
    return argv


@dataclass(frozen=True)
class HiCacheOptions:
    """The HiCache tiers of one ``kvflow serve`` process: its ``--hicache-*`` flags.

    Declared once, here: each field is the flag ``--hicache-<name>`` (help text in its
    metadata, see :data:`HICACHE_FLAGS`) and the runtime's ``EngineConfig.hicache_<name>``
    (see :data:`HICACHE_ENGINE_FIELDS`), whose default is the field's default. ``storage``
    names a shared store (L3) backend; :data:`NO_STORAGE` leaves it, and its path, out.
    """

    host_memory_gb: float = field(
        default=0.0, metadata={"help": "host-memory KV tier size in GiB (0 disables HiCache)"}
    )
    write_policy: str = field(
        default="write_through", metadata={"help": "write_through | write_back"}
    )
    storage: str = field(
        default=NO_STORAGE, metadata={"help": f"shared store (L3) backend; {NO_STORAGE}: no store"}
    )
    storage_path: str = field(
        default="", metadata={"help": "where the shared store is: a directory or an address"}
    )

    def argv(self) -> list[str]:
        """The ``--hicache-*`` flags of these options (the path only with a store)."""
        values = {_hicache_flag(f.name): getattr(self, f.name) for f in fields(self)}
        if self.storage == NO_STORAGE:
            del values[_hicache_flag("storage")], values[_hicache_flag("storage_path")]
        return _argv(HICACHE_FLAGS, values)


def _hicache_flag(name: str) -> str:
    return "--hicache-" + name.replace("_", "-")


HICACHE_FLAGS: Mapping[str, str] = {
    _hicache_flag(f.name): f.metadata["help"] for f in fields(HiCacheOptions)
}
# The same settings as the runtime's EngineConfig fields (and argparse destinations).
HICACHE_ENGINE_FIELDS: tuple[str, ...] = tuple(f"hicache_{f.name}" for f in fields(HiCacheOptions))

# ``kvflow serve``'s flags, in the order rendered (the HiCache ones from HiCacheOptions).
SERVE_FLAGS: Mapping[str, str] = {
    "--model-path": "local Hugging Face folder; empty means the embedded SmolLM2-135M-Instruct",
    "--served-model-name": "model name reported by /v1/models",
    "--host": "address to bind",
    "--port": "API port",
    "--role": "unified | prefill | decode",
    "--bootstrap-port": "KV-transfer bootstrap port (prefill role)",
    "--kv-transfer-protocol": "tcp | rdma | nvlink_intra",
    **HICACHE_FLAGS,
    "--max-running-requests": "largest running batch",
}
# Flags the operator also renders whose declaration (type, default, choices) stays with the
# runtime's parser, which checks the value against its own registry or EngineConfig field;
# the runtime does not declare these from here (it would declare them twice). SGLang's names.
SERVE_RUNTIME_FLAGS: Mapping[str, str] = {
    "--disaggregation-transfer-backend": "prefill/decode: the KV transport (the runtime's "
    "KV_TRANSPORTS, e.g. mooncake)",
    "--tp-size": "GPUs that shard one copy of the model (tensor parallelism)",
    "--dp-size": "data-parallel copies of the model in one server (each on --tp-size GPUs)",
    "--nnodes": "nodes (pods) one tensor-parallel group spans",
    "--node-rank": "this pod's node number, 0 .. --nnodes - 1 (0 serves HTTP)",
    "--dist-init-addr": "HOST:PORT where the group's ranks meet (node 0's)",
    "--enable-lora": "serve LoRA adapters (loaded while serving; docs/lora.md)",
    "--max-loras-per-batch": "LoRA device slots: distinct adapters one batch runs",
    "--max-lora-rank": "the largest LoRA rank accepted",
    "--lora-target-modules": "projections an adapter may target (slots are sized for them)",
}
# SGLang's other spellings of two of them, which the runtime also accepts (a spec's extra
# flags may not use them either).
SERVE_FLAG_ALIASES: Mapping[str, str] = {
    "--tp": "--tp-size",
    "--tensor-parallel-size": "--tp-size",
    "--dp": "--dp-size",
    "--data-parallel-size": "--dp-size",
}
# Flags the spec owns without the operator rendering them: extra flags may not set them
# either (adapters come from spec.lora.adapters, which the router loads and routes by).
SERVE_SPEC_OWNED_FLAGS: tuple[str, ...] = ("--lora-paths",)
_RENDERED_SERVE_FLAGS: Mapping[str, str] = {**SERVE_FLAGS, **SERVE_RUNTIME_FLAGS}


@dataclass(frozen=True)
class LoraOptions:
    """A LoRA-serving ``kvflow serve``: ``--enable-lora`` with its device slots sized up
    front (adapters come later, through ``/load_lora_adapter``, so the rank and targets
    cannot be read from start-up adapters)."""

    max_loras_per_batch: int = 8
    max_lora_rank: int = 16
    target_modules: tuple[str, ...] = ("all",)

    def argv(self) -> list[str]:
        return [
            "--enable-lora",
            "--max-loras-per-batch",
            str(self.max_loras_per_batch),
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--lora-target-modules",
            *self.target_modules,
        ]


@dataclass(frozen=True)
class ServeOptions:
    """What the operator decides about one runtime pod; rendered by :func:`serve_argv`.

    ``hicache`` None renders no ``--hicache-*`` flag (the runtime then runs no tiers).
    """

    model_path: str = ""
    served_model_name: str = ""
    role: str = "unified"
    host: str = "0.0.0.0"
    port: int = DEFAULT_API_PORT
    bootstrap_port: int | None = None
    kv_transfer_protocol: str | None = None
    kv_transfer_backend: str | None = None  # prefill/decode only
    tp_size: int | None = None  # None (or 1): not rendered, the runtime's default of 1
    dp_size: int | None = None
    # one group over several pods: every pod runs the same command but its node rank (a
    # "$(VAR)" the kubelet expands), all meeting at node 0's dist_init_addr
    nnodes: int | None = None  # None (or 1): not rendered
    node_rank: str | None = None
    dist_init_addr: str | None = None
    hicache: HiCacheOptions | None = None
    lora: LoraOptions | None = None
    max_running_requests: int | None = None
    extra_args: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


def serve_argv(opts: ServeOptions) -> list[str]:
    """The container command for a runtime pod: ``kvflow serve <flags>``."""
    values = {
        "--model-path": opts.model_path,
        "--served-model-name": opts.served_model_name,
        "--host": opts.host,
        "--port": opts.port,
        "--role": opts.role,
        "--bootstrap-port": opts.bootstrap_port,
        "--kv-transfer-protocol": opts.kv_transfer_protocol,
        "--disaggregation-transfer-backend": opts.kv_transfer_backend,
        "--tp-size": opts.tp_size if opts.tp_size != 1 else None,
        "--dp-size": opts.dp_size if opts.dp_size != 1 else None,
        "--nnodes": opts.nnodes if opts.nnodes != 1 else None,
        "--node-rank": opts.node_rank,
        "--dist-init-addr": opts.dist_init_addr,
    }
    hicache = opts.hicache.argv() if opts.hicache is not None else []
    lora = opts.lora.argv() if opts.lora is not None else []
    batch = {"--max-running-requests": opts.max_running_requests}
    return [
        "kvflow",
        "serve",
        *_argv(_RENDERED_SERVE_FLAGS, values),
        *hicache,
        *lora,
        *_argv(_RENDERED_SERVE_FLAGS, batch),
        *opts.extra_args,
    ]


@dataclass(frozen=True)
class RouterOptions:
    """What the operator decides about the router pod; rendered by :func:`router_argv`."""

    policy: str = "cache_aware"
    host: str = "0.0.0.0"
    port: int = DEFAULT_API_PORT
    worker_urls: Sequence[str] = ()
    prefill_urls: Sequence[str] = ()
    decode_urls: Sequence[str] = ()
    discover_namespace: str | None = None
    discover_selector: str | None = None
    lora_adapters: Mapping[str, str] = field(default_factory=dict)  # static workers only
    extra_args: Sequence[str] = field(default_factory=tuple)


def router_argv(opts: RouterOptions) -> list[str]:
    """The container command for the router pod: ``kvflow router <flags>``."""
    values = {
        "--host": opts.host,
        "--port": opts.port,
        "--policy": opts.policy,
        "--worker-urls": ",".join(opts.worker_urls),
        "--prefill-urls": ",".join(opts.prefill_urls),
        "--decode-urls": ",".join(opts.decode_urls),
        "--discover-namespace": opts.discover_namespace,
        "--discover-selector": opts.discover_selector,
        "--lora-adapters": format_lora_adapters(opts.lora_adapters),
    }
    return ["kvflow", "router", *_argv(ROUTER_FLAGS, values), *opts.extra_args]
