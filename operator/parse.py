"""Reading a ModelDeployment resource body into :class:`spec.ModelDeployment`.

:func:`parse_model_deployment` takes the body as the API server returns it (CRD defaults
applied) or as written in a file (defaults filled in here). Anything the CRD's schema
cannot check is checked here and reported as :class:`SpecError` naming the field.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

from kvflow import contract

from .lora import ADAPTER_NAME, ADAPTER_SOURCES, host_folder_refusal
from .paths import OPERATOR_ENV, OPERATOR_VOLUMES
from .quantity import QuantityError, parse_quantity
from .spec import (
    DEFAULT_ROUTER_IMAGE,
    DEFAULT_RUNTIME_IMAGE,
    Autoscaling,
    Endpoint,
    HiCache,
    KVTransfer,
    Lora,
    LoraAdapter,
    ModelDeployment,
    ModelSource,
    MooncakeMaster,
    NetworkPolicySettings,
    PodSettings,
    RouterRole,
    SecretKeyRef,
    SpecError,
    WorkerRole,
)
from .stores import STORES, shared_store, store_type


def _secret_ref(raw: Mapping[str, Any] | None, default_key: str) -> SecretKeyRef | None:
    if not raw:
        return None
    return SecretKeyRef(name=str(raw["name"]), key=str(raw.get("key") or default_key))


def _quantities(raw: Mapping[str, Any] | None, path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for resource, amount in (raw or {}).items():
        try:
            parse_quantity(amount)
        except QuantityError as exc:
            raise SpecError(f"{path}.{resource}", str(exc)) from exc
        out[str(resource)] = str(amount)
    return out


def _volumes(raw: Mapping[str, Any], path: str) -> tuple[tuple[dict[str, Any], ...], ...]:
    """``volumes`` and ``volumeMounts``: user volumes beside the operator's own."""
    volumes = tuple(dict(v) for v in raw.get("volumes") or ())
    mounts = tuple(dict(m) for m in raw.get("volumeMounts") or ())
    declared = _named(volumes, f"{path}.volumes", OPERATOR_VOLUMES, "used by the operator")
    reserved_paths = set(OPERATOR_VOLUMES.values())
    for i, mount in enumerate(mounts):
        name, mount_path = str(mount.get("name", "")), str(mount.get("mountPath", ""))
        if name not in declared:
            raise SpecError(
                f"{path}.volumeMounts[{i}].name", f"{name!r} is not one of {path}.volumes"
            )
        if not mount_path.startswith("/"):
            raise SpecError(f"{path}.volumeMounts[{i}].mountPath", "must be an absolute path")
        if mount_path.rstrip("/") in reserved_paths:
            raise SpecError(
                f"{path}.volumeMounts[{i}].mountPath", f"{mount_path} is mounted by the operator"
            )
    return volumes, mounts


def _env(raw: Mapping[str, Any], path: str) -> tuple[dict[str, Any], ...]:
    """``env``: variables of the user's own names (the operator sets :data:`OPERATOR_ENV`,
    and a container's env may name a variable once)."""
    env = tuple(dict(e) for e in raw.get("env") or ())
    _named(env, f"{path}.env", OPERATOR_ENV, "set by the operator")
    return env


def _named(
    entries: tuple[dict[str, Any], ...], path: str, reserved: Collection[str], why: str
) -> set[str]:
    """The names of ``entries``: each required, once, and none of ``reserved``."""
    declared: set[str] = set()
    for i, entry in enumerate(entries):
        name = str(entry.get("name", ""))
        if not name:
            raise SpecError(f"{path}[{i}].name", "required")
        if name in reserved or name in declared:
            taken = why if name in reserved else "declared twice"
            raise SpecError(f"{path}[{i}].name", f"{name!r} is {taken}")
        declared.add(name)
    return declared


def _pods(raw: Mapping[str, Any], path: str) -> PodSettings:
    resources = raw.get("resources") or {}
    volumes, mounts = _volumes(raw, path)
    image = raw.get("image")
    return PodSettings(
        requests=_quantities(resources.get("requests"), f"{path}.resources.requests"),
        limits=_quantities(resources.get("limits"), f"{path}.resources.limits"),
        node_selector={str(k): str(v) for k, v in (raw.get("nodeSelector") or {}).items()},
        tolerations=tuple(dict(t) for t in raw.get("tolerations") or ()),
        env=_env(raw, path),
        extra_args=tuple(str(a) for a in raw.get("extraArgs") or ()),
        image=None if image is None else str(image),
        host_network=bool(raw.get("hostNetwork", False)),
        volumes=volumes,
        volume_mounts=mounts,
    )


def _port(raw: Mapping[str, Any], name: str, default: int, path: str) -> int:
    value = (raw.get("ports") or {}).get(name, default)
    if not isinstance(value, int) or not 1 <= value <= 65535:
        raise SpecError(f"{path}.ports.{name}", f"must be a port number, got {value!r}")
    return value


def _autoscaling(raw: Mapping[str, Any] | None) -> Autoscaling:
    raw = raw or {}
    targets = raw.get("targets") or {}
    return Autoscaling(
        enabled=bool(raw.get("enabled", False)),
        min_replicas=int(raw.get("minReplicas", 1)),
        max_replicas=int(raw.get("maxReplicas", 4)),
        scale_down_stabilization_seconds=int(raw.get("scaleDownStabilizationSeconds", 300)),
        queue_per_replica=targets.get("queuePerReplica"),
        kv_usage=targets.get("kvUsage"),
        ttft_ms=targets.get("ttftMs"),
        itl_ms=targets.get("itlMs"),
    )


def _tensor_parallel_size(raw: Mapping[str, Any], gpus: int, nodes: int, path: str) -> int | None:
    """``tensorParallelSize``, checked as the CRD does: it divides ``gpus`` (>= 1), or over
    several nodes equals ``gpus x nodesPerReplica`` (the runtime runs one group there)."""
    if raw.get("tensorParallelSize") is None:
        return None
    tp = int(raw["tensorParallelSize"])
    if nodes > 1 and (gpus < 1 or tp != gpus * nodes):
        raise SpecError(
            f"{path}.tensorParallelSize",
            f"{tp} must equal {path}.gpus x {path}.nodesPerReplica ({gpus} x {nodes}): a "
            "group over several nodes runs one tensor-parallel copy (--dp-size 1)",
        )
    if nodes > 1:
        return tp
    if tp < 1 or gpus < 1 or gpus % tp:
        raise SpecError(
            f"{path}.tensorParallelSize",
            f"{tp} must be >= 1 and divide {path}.gpus ({gpus}, which must be >= 1)",
        )
    return tp


def _nodes_per_replica(raw: Mapping[str, Any], path: str) -> int:
    """``nodesPerReplica``: >= 1; above 1 only where the runtime and the operator build it
    (the unified role, no autoscaling: its signals and scaling read one pod per replica)."""
    nodes = int(raw.get("nodesPerReplica", 1))
    if nodes < 1:
        raise SpecError(f"{path}.nodesPerReplica", f"{nodes} must be >= 1")
    if nodes > 1 and path != "spec.unified":
        raise SpecError(
            f"{path}.nodesPerReplica",
            "only the unified role spans nodes (the runtime's --nnodes is not built for "
            "prefill/decode roles; docs/parallelism.md)",
        )
    if nodes > 1 and (raw.get("autoscaling") or {}).get("enabled"):
        raise SpecError(
            f"{path}.autoscaling.enabled",
            "autoscaling is not built for a role over several nodes (nodesPerReplica > 1)",
        )
    return nodes


def _worker(role: str, raw: Mapping[str, Any] | None) -> WorkerRole:
    raw = raw or {}
    gpus = int(raw.get("gpus", 0))
    path = f"spec.{role}"
    nodes = _nodes_per_replica(raw, path)
    return WorkerRole(
        role=role,
        replicas=int(raw.get("replicas", 1)),
        gpus=gpus,
        tensor_parallel_size=_tensor_parallel_size(raw, gpus, nodes, path),
        nodes_per_replica=nodes,
        pods=_pods(raw, f"spec.{role}"),
        http_port=_port(raw, "http", contract.DEFAULT_API_PORT, f"spec.{role}"),
        max_running_requests=raw.get("maxRunningRequests"),
        startup_timeout_seconds=int(raw.get("startupTimeoutSeconds", 1800)),
        autoscaling=_autoscaling(raw.get("autoscaling")),
    )


def _source(raw: Mapping[str, Any], path: str, default: str) -> ModelSource:
    """A weights folder's source (``spec.model``, ``spec.lora.adapters[i]``): the field
    ``source`` names, which must be set."""
    source = str(raw.get("source", default))
    pvc = raw.get("pvc") or {}
    hf = raw.get("huggingFace") or {}
    model = ModelSource(
        source=source,
        served_model_name=str(raw.get("servedModelName", "")),
        claim_name=str(pvc.get("claimName", "")),
        claim_path=str(pvc.get("path", "")),
        host_path=str((raw.get("hostPath") or {}).get("path", "")),
        hf_id=str(hf.get("id", "")),
        hf_revision=str(hf.get("revision") or "main"),
        hf_token=_secret_ref(hf.get("tokenSecretRef"), "token"),
    )
    required = {"pvc": model.claim_name, "hostPath": model.host_path, "huggingFace": model.hf_id}
    if source in required and not required[source]:
        raise SpecError(f"{path}.{source}", f"required when {path}.source is {source}")
    return model


def _model(raw: Mapping[str, Any]) -> ModelSource:
    return _source(raw, "spec.model", "embedded")


def _hicache(raw: Mapping[str, Any] | None) -> HiCache:
    raw = raw or {}
    store = raw.get("sharedStore") or {}
    hicache = HiCache(
        host_memory=None if raw.get("hostMemory") is None else str(raw["hostMemory"]),
        write_policy=str(raw.get("writePolicy", "write_through")),
        store=str(store.get("type", "none")),
        store_size=None if store.get("size") is None else str(store["size"]),
        storage_class=store.get("storageClassName"),
    )
    for path, amount in (
        ("spec.hiCache.hostMemory", hicache.host_memory),
        ("spec.hiCache.sharedStore.size", hicache.store_size),
    ):
        if amount is not None:
            try:
                parse_quantity(amount)
            except QuantityError as exc:
                raise SpecError(path, str(exc)) from exc
    if hicache.store != contract.NO_STORAGE:
        if hicache.store not in STORES:
            choices = ", ".join([contract.NO_STORAGE, *sorted(STORES)])
            raise SpecError(
                "spec.hiCache.sharedStore.type", f"unknown store {hicache.store!r} ({choices})"
            )
        if not hicache.enabled:
            raise SpecError(
                "spec.hiCache.hostMemory", "must be positive when a shared store is set"
            )
    return hicache


def _lora(raw: Mapping[str, Any] | None) -> Lora | None:
    """``spec.lora``: slot sizes and the adapters, each named once (names go into requests
    as ``lora_path`` or ``model: base:name``, hence no ``:``)."""
    if raw is None:
        return None
    adapters: list[LoraAdapter] = []
    for i, entry in enumerate(raw.get("adapters") or ()):
        path = f"spec.lora.adapters[{i}]"
        name = str(entry.get("name", ""))
        if not ADAPTER_NAME.fullmatch(name):
            raise SpecError(f"{path}.name", f"{name!r} is not {ADAPTER_NAME.pattern}")
        if any(a.name == name for a in adapters):
            raise SpecError(f"{path}.name", f"{name!r} is declared twice")
        source = _source(entry, path, "")
        if source.source not in ADAPTER_SOURCES:
            raise SpecError(f"{path}.source", f"must be one of {', '.join(ADAPTER_SOURCES)}")
        if source.source == "hostPath" and (refusal := host_folder_refusal(source.host_path)):
            raise SpecError(f"{path}.hostPath.path", refusal)
        if "," in source.claim_path + source.host_path:  # the router's lists are NAME=PATH,...
            raise SpecError(f"{path}.{source.source}.path", "must not contain ','")
        adapters.append(LoraAdapter(name, source))
    defaults = Lora()
    lora = Lora(
        max_loras_per_batch=int(raw.get("maxLorasPerBatch", defaults.max_loras_per_batch)),
        max_lora_rank=int(raw.get("maxLoraRank", defaults.max_lora_rank)),
        target_modules=tuple(str(m) for m in raw.get("targetModules") or defaults.target_modules),
        adapters=tuple(adapters),
    )
    if lora.max_loras_per_batch < 1 or lora.max_lora_rank < 1:
        raise SpecError("spec.lora", "maxLorasPerBatch and maxLoraRank must be >= 1")
    return lora


def _check_lora(md: ModelDeployment) -> None:
    """LoRA where the runtime serves it: generation (any tensor/data parallelism)."""
    if md.lora is None:
        return
    for worker in md.workers:
        if "--is-embedding" in worker.pods.extra_args:
            raise SpecError(
                "spec.lora", f"spec.{worker.role} serves embeddings: LoRA serves generation"
            )


def _store_sections(spec: Mapping[str, Any], chosen: str) -> None:
    """Spec sections of a store other than the chosen one are refused."""
    for kind in STORES:
        sections = store_type(kind).spec_sections if kind != chosen else ()
        for section in sections:
            if section in spec:
                raise SpecError(
                    f"spec.{section}", f"only valid when spec.hiCache.sharedStore.type is {kind}"
                )


def _mooncake_master(raw: Mapping[str, Any] | None) -> MooncakeMaster:
    raw = raw or {}
    path = "spec.mooncakeMaster"
    return MooncakeMaster(
        pods=_pods(raw, path),
        rpc_port=_port(raw, "rpc", contract.MOONCAKE_MASTER_RPC_PORT, path),
        metadata_port=_port(raw, "metadata", contract.MOONCAKE_MASTER_METADATA_PORT, path),
        metrics_port=_port(raw, "metrics", contract.MOONCAKE_MASTER_METRICS_PORT, path),
        host=str(raw.get("host", "")),
    )


def _check_ports(md: ModelDeployment) -> None:
    """Ports one pod binds are distinct, and so are those of every host-network role: host-
    network pods bind on the node, and a deployment's roles may share one node."""
    bound: dict[int, str] = {}
    host_network = []
    for worker in md.workers:
        ports = {f"spec.{worker.role}.ports.http": worker.http_port}
        if worker.role == "prefill":
            ports["spec.kvTransfer.bootstrapPort"] = md.kv_transfer.bootstrap_port
        if worker.spans_nodes:  # the group's leader meets its workers there
            ports[f"spec.{worker.role}.nodesPerReplica"] = contract.DIST_INIT_PORT
        host_network.append((worker.pods.host_network, ports))
    host_network.append(
        (md.router.pods.host_network, {"spec.router.ports.http": md.router.http_port})
    )
    store = shared_store(md)
    host_network += store.bound_ports() if store is not None else []
    for on_host, ports in host_network:
        in_pod: dict[int, str] = {}
        for field_path, port in ports.items():
            if port in in_pod:
                raise SpecError(field_path, f"port {port} is also {in_pod[port]} (same pod)")
            in_pod[port] = field_path
            if on_host and port in bound:
                raise SpecError(
                    field_path,
                    f"port {port} is also {bound[port]}; both roles use the host network",
                )
            if on_host:
                bound[port] = field_path


def _check_parallelism(md: ModelDeployment) -> None:
    """Prefill and decode roles run one model copy per pod (the runtime has no
    ``--dp-size`` for them), sharded with ``--tp-size`` over every GPU of the pod, and the
    same size on both sides (each prefill rank writes its KV-head shard into the decode
    rank of its number; docs/parallelism.md)."""
    if not md.disaggregated:
        return
    sizes = {}
    for worker in md.workers:
        if worker.dp_size > 1:
            raise SpecError(
                f"spec.{worker.role}.tensorParallelSize",
                f"{worker.tp_size} of {worker.gpus} GPUs: a {worker.role} pod runs one model "
                "copy over all of its GPUs (--dp-size is not built for prefill/decode roles; "
                "docs/parallelism.md); drop tensorParallelSize or set it to gpus, and add "
                "replicas for more copies",
            )
        sizes[worker.role] = worker.tp_size
    if sizes["prefill"] != sizes["decode"]:
        raise SpecError(
            "spec.decode.gpus",
            f"the prefill shards the model over {sizes['prefill']} GPUs and the decode over "
            f"{sizes['decode']}: prefill and decode need the same tensor-parallel size (each "
            "prefill rank writes its KV heads into the decode rank of its number; "
            "docs/parallelism.md)",
        )


# A LeaderWorkerSet <name>-<role> names StatefulSets <name>-<role>-<group>, which must stay
# within 52 characters (their pods' controller-revision-hash label adds 11).
MAX_GROUPED_NAME = 38


def _check_group_names(md: ModelDeployment) -> None:
    """The CRD's cap on names of deployments with a role over several nodes."""
    if any(w.spans_nodes for w in md.workers) and len(md.name) > MAX_GROUPED_NAME:
        raise SpecError(
            "metadata.name",
            f"must be at most {MAX_GROUPED_NAME} characters with a role over several nodes "
            "(its LeaderWorkerSet's StatefulSets <name>-<role>-<group> stay within 52)",
        )


def parse_model_deployment(body: Mapping[str, Any]) -> ModelDeployment:
    """Read a ModelDeployment resource body; raises :class:`SpecError` naming the field."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    mode = str(spec.get("mode", "unified"))
    workers: tuple[WorkerRole, ...]
    if mode == "disaggregated":
        for role in ("prefill", "decode"):
            if role not in spec:
                raise SpecError(f"spec.{role}", "required when spec.mode is disaggregated")
        workers = (_worker("prefill", spec["prefill"]), _worker("decode", spec["decode"]))
    elif mode == "unified":
        workers = (_worker("unified", spec.get("unified")),)
    else:
        raise SpecError("spec.mode", f"unsupported value {mode!r}")
    router = spec.get("router") or {}
    kv = spec.get("kvTransfer") or {}
    endpoint = spec.get("endpoint") or {}
    netpol = spec.get("networkPolicy") or {}
    hicache = _hicache(spec.get("hiCache"))
    _store_sections(spec, hicache.store)
    md = ModelDeployment(
        name=str(meta["name"]),
        namespace=str(meta.get("namespace") or "default"),
        uid=str(meta.get("uid", "")),
        generation=int(meta.get("generation", 1)),
        mode=mode,
        model=_model(spec.get("model") or {}),
        image=str(spec.get("image", DEFAULT_RUNTIME_IMAGE)),
        image_pull_policy=str(spec.get("imagePullPolicy", "IfNotPresent")),
        image_pull_secrets=tuple(str(s["name"]) for s in spec.get("imagePullSecrets") or ()),
        workers=workers,
        router=RouterRole(
            replicas=int(router.get("replicas", 1)),
            image=str(router.get("image", DEFAULT_ROUTER_IMAGE)),
            policy=str(router.get("policy", "cache_aware")),
            pods=replace(_pods(router, "spec.router"), image=None),  # the field above
            http_port=_port(router, "http", contract.DEFAULT_API_PORT, "spec.router"),
        ),
        mooncake_master=_mooncake_master(spec.get("mooncakeMaster")),
        kv_transfer=KVTransfer(
            backend=str(kv.get("backend", "mooncake")),
            protocol=str(kv.get("protocol", "tcp")),
            bootstrap_port=int(kv.get("bootstrapPort", contract.DEFAULT_BOOTSTRAP_PORT)),
        ),
        hicache=hicache,
        lora=_lora(spec.get("lora")),
        endpoint=Endpoint(
            port=int(endpoint.get("port", contract.DEFAULT_API_PORT)),
            service_type=str(endpoint.get("serviceType", "ClusterIP")),
            api_key=_secret_ref(endpoint.get("apiKeySecretRef"), "api-key"),
        ),
        network_policy=NetworkPolicySettings(
            enabled=bool(netpol.get("enabled", True)),
            metrics_namespace_labels=dict(netpol.get("metricsNamespaceSelector") or {}),
        ),
    )
    store = shared_store(md)
    if store is not None:
        store.check()
    _check_ports(md)
    _check_parallelism(md)
    _check_group_names(md)
    _check_lora(md)
    return md
