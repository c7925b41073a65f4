"""The ModelDeployment spec as typed, frozen dataclasses (read by ``parse.py``).

Defaults repeat the CRD's, so that a spec read from a file (``kvflow up``, unit tests)
means what the API server would make of it; a test checks the two agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow import contract

from .quantity import parse_quantity

DEFAULT_RUNTIME_IMAGE = "ghcr.io/kvflow/runtime:0.1.0"
DEFAULT_ROUTER_IMAGE = "ghcr.io/kvflow/router:0.1.0"


class SpecError(ValueError):
    """A spec the operator cannot render; ``field`` is its path, e.g. ``spec.hiCache.hostMemory``."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field_path = field_path


@dataclass(frozen=True)
class SecretKeyRef:
    """One key of a Secret in the deployment's namespace."""

    name: str
    key: str


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from (``spec.model``)."""

    source: str = "embedded"  # embedded | pvc | hostPath | huggingFace
    served_model_name: str = ""
    claim_name: str = ""
    claim_path: str = ""
    host_path: str = ""
    hf_id: str = ""
    hf_revision: str = "main"
    hf_token: SecretKeyRef | None = None


@dataclass(frozen=True)
class LoraAdapter:
    """One entry of ``spec.lora.adapters``: a PEFT folder named ``name`` in requests
    (``lora_path``, ``model: base:name``), from a PVC, a node folder or the Hub."""

    name: str
    source: ModelSource  # source is pvc, hostPath or huggingFace


@dataclass(frozen=True)
class Lora:
    """``spec.lora``: the workers serve LoRA adapters; the router keeps ``adapters`` loaded
    on every worker pod (docs/lora.md, "In a ModelDeployment")."""

    max_loras_per_batch: int = 8
    max_lora_rank: int = 16
    target_modules: tuple[str, ...] = ("all",)
    adapters: tuple[LoraAdapter, ...] = ()


@dataclass(frozen=True)
class Autoscaling:
    """Per-role autoscaling bounds and targets (acted on by the autoscaler)."""

    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    scale_down_stabilization_seconds: int = 300
    queue_per_replica: int | None = None
    kv_usage: float | None = None
    ttft_ms: int | None = None
    itl_ms: int | None = None


@dataclass(frozen=True)
class PodSettings:
    """One role's pod settings: image, scheduling, resources, env, volumes, extra flags.

    ``image`` is None when the role takes the deployment's default image. ``host_network``
    runs the pods in the node's network namespace (RDMA deployments do; the pods then bind
    the role's ports on the node, so roles sharing a node need distinct ports).
    """

    requests: Mapping[str, str] = field(default_factory=dict)
    limits: Mapping[str, str] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    env: Sequence[Mapping[str, Any]] = ()
    extra_args: Sequence[str] = ()
    image: str | None = None
    host_network: bool = False
    volumes: Sequence[Mapping[str, Any]] = ()
    volume_mounts: Sequence[Mapping[str, Any]] = ()


@dataclass(frozen=True)
class WorkerRole:
    """``spec.unified`` / ``spec.prefill`` / ``spec.decode``: pods running ``kvflow serve``."""

    role: str
    replicas: int = 1  # the user's number; rendered sizes are a sizes.DesiredSizes
    gpus: int = 0
    tensor_parallel_size: int | None = None  # None: every GPU shards one copy (tp = gpus)
    # pods (one per node: SGLang's --nnodes) one replica spans; above 1 the role renders a
    # LeaderWorkerSet whose groups run one tensor-parallel copy over all of their GPUs
    nodes_per_replica: int = 1
    pods: PodSettings = field(default_factory=PodSettings)
    http_port: int = contract.DEFAULT_API_PORT  # API, /health and /metrics
    max_running_requests: int | None = None
    startup_timeout_seconds: int = 1800
    autoscaling: Autoscaling = field(default_factory=Autoscaling)

    @property
    def spans_nodes(self) -> bool:
        """Whether one replica is a group of several pods (a LeaderWorkerSet's)."""
        return self.nodes_per_replica > 1

    @property
    def tp_size(self) -> int:
        """Ranks per model copy (``--tp-size``): GPUs, or one rank per pod without GPUs."""
        return self.tensor_parallel_size or max(self.gpus, 1) * self.nodes_per_replica

    @property
    def dp_size(self) -> int:
        """Model copies per replica (``--dp-size``): every GPU of every pod is used."""
        return max(self.gpus, 1) * self.nodes_per_replica // self.tp_size


@dataclass(frozen=True)
class RouterRole:
    """``spec.router``: pods running ``kvflow router``."""

    replicas: int = 1
    image: str = DEFAULT_ROUTER_IMAGE
    policy: str = "cache_aware"
    pods: PodSettings = field(default_factory=PodSettings)
    http_port: int = contract.DEFAULT_API_PORT  # API, /health, /readiness and /metrics


@dataclass(frozen=True)
class MooncakeMaster:
    """``spec.mooncakeMaster``: the Mooncake master's pods and ports (mooncake store only).

    ``host`` is where runtime pods reach the master; empty means its Service's DNS name.
    A host-network master on a node without Service routing (the loopback test node) is
    reached at the node's address instead.
    """

    pods: PodSettings = field(default_factory=PodSettings)
    rpc_port: int = contract.MOONCAKE_MASTER_RPC_PORT
    metadata_port: int = contract.MOONCAKE_MASTER_METADATA_PORT
    metrics_port: int = contract.MOONCAKE_MASTER_METRICS_PORT
    host: str = ""


@dataclass(frozen=True)
class KVTransfer:
    """``spec.kvTransfer``: how prefill pods hand KV pages to decode pods."""

    backend: str = "mooncake"
    protocol: str = "tcp"
    bootstrap_port: int = contract.DEFAULT_BOOTSTRAP_PORT


@dataclass(frozen=True)
class HiCache:
    """``spec.hiCache``: host-memory tier (L2) and shared store (L3).

    ``store`` is a kind of :data:`stores.STORES` or ``none``; ``store_size`` means what that
    store makes of it.
    """

    host_memory: str | None = None
    write_policy: str = "write_through"
    store: str = contract.NO_STORAGE
    store_size: str | None = None
    storage_class: str | None = None

    @property
    def host_memory_bytes(self) -> int:
        return int(parse_quantity(self.host_memory)) if self.host_memory else 0

    @property
    def enabled(self) -> bool:
        return self.host_memory_bytes > 0


@dataclass(frozen=True)
class Endpoint:
    """``spec.endpoint``: the router Service and its API key."""

    port: int = contract.DEFAULT_API_PORT
    service_type: str = "ClusterIP"
    api_key: SecretKeyRef | None = None


@dataclass(frozen=True)
class NetworkPolicySettings:
    """``spec.networkPolicy``."""

    enabled: bool = True
    metrics_namespace_labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelDeployment:
    """A parsed ModelDeployment: identity plus the spec every builder reads."""

    name: str
    namespace: str
    uid: str
    generation: int
    mode: str = "unified"
    model: ModelSource = field(default_factory=ModelSource)
    image: str = DEFAULT_RUNTIME_IMAGE
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: Sequence[str] = ()
    workers: Sequence[WorkerRole] = (WorkerRole("unified"),)
    router: RouterRole = field(default_factory=RouterRole)
    mooncake_master: MooncakeMaster = field(default_factory=MooncakeMaster)
    kv_transfer: KVTransfer = field(default_factory=KVTransfer)
    hicache: HiCache = field(default_factory=HiCache)
    lora: Lora | None = None
    endpoint: Endpoint = field(default_factory=Endpoint)
    network_policy: NetworkPolicySettings = field(default_factory=NetworkPolicySettings)

    @property
    def disaggregated(self) -> bool:
        return self.mode == "disaggregated"

    def worker_image(self, worker: WorkerRole) -> str:
        """The image a worker role runs: its own, else the deployment's."""
        return worker.pods.image or self.image

    @property
    def mooncake_master_image(self) -> str:
        """The Mooncake master's image: its own, else the runtime image (which carries it)."""
        return self.mooncake_master.pods.image or self.image
