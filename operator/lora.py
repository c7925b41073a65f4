"""``spec.lora``: where each adapter's files are in a worker pod, and what puts them there.

The pod template depends only on where adapters are *stored*, never on the list itself, so
that adding or removing an adapter whose storage is already mounted leaves the pods
running (the router loads and unloads it, see ``runtime/router/adapters.py``):

- ``pvc``: each distinct claim is mounted read-only at ``/adapters/pvc/<claimName>``; the
  adapter is ``path`` inside it. More adapters on the same claim change nothing.
- ``hostPath``: the adapter folder's *parent* is mounted read-only at the same path as on
  the node, so adapters side by side in one folder share one volume, and an adapter has
  the same path in a pod as under ``kvflow up`` (which reads the node's folder directly).
- ``huggingFace``: an init container per adapter runs ``hf download`` into an emptyDir at
  ``/adapters/hf/<name>``; a new one is a new init container, so the pods roll once.

The adapters the router keeps loaded on a pod travel in the pod's
:data:`contract.LORA_ADAPTERS_ANNOTATION` (written by the reconciler on running pods).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvflow import contract

from .paths import ADAPTERS_DIR, CACHE_DIR, HF_HOME_ENV, OPERATOR_VOLUMES
from .podparts import container_security_context, empty_dir, secret_env
from .spec import LoraAdapter, ModelDeployment

__all__ = [
    "ADAPTER_NAME",
    "ADAPTER_SOURCES",
    "AdapterStorage",
    "adapter_annotation",
    "cluster_adapter_storage",
    "host_folder_refusal",
    "local_adapter_paths",
    "lora_options",
    "pods_to_annotate",
]

# No ":" (``model: base:adapter``), "," or "=" (the router's NAME=PATH lists).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ADAPTER_SOURCES = ("pvc", "hostPath", "huggingFace")
HF_ADAPTERS_DIR = f"{ADAPTERS_DIR}/hf"
HF_VOLUME = "lora-hf"
# Folders a node folder's parent may not be mounted over (or above) in a runtime container.
_SYSTEM_DIRS: tuple[str, ...] = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc")
_SYSTEM_DIRS += ("/run", "/sbin", "/sys", "/usr", "/opt", ADAPTERS_DIR)


def host_folder_refusal(path: str) -> str | None:
    """Why a ``hostPath`` adapter folder cannot be served, or None. Its parent is mounted at
    its own path in the pods, so it must not hide the image's folders (at or below a system
    folder) nor the operator's mounts (at or above one; below one it is mounted inside it,
    as a pytest or ``/tmp`` folder is under the pods' ``/tmp``)."""
    parts = path.split("/")
    if not path.startswith("/") or ".." in parts or "" in parts[1:]:
        return "must be an absolute, normalized path (no '..', no '//', no trailing '/')"
    parent = posixpath.dirname(path)
    if parent == "/":
        return (
            "the adapter's parent folder is mounted into the pods at the same path: put the "
            "adapter in a folder below a top-level one (e.g. /data/adapters/NAME)"
        )
    for system in _SYSTEM_DIRS:
        if parent == system or parent.startswith(system + "/"):
            return f"its parent folder {parent} would be mounted over {system} in the pods"
    for mounted in OPERATOR_VOLUMES.values():
        if parent == mounted or mounted.startswith(parent + "/"):
            return f"its parent folder {parent} would be mounted over {mounted} in the pods"
    return None


@dataclass(frozen=True)
class AdapterStorage:
    """What a worker pod needs for ``spec.lora``: volumes, the runtime container's mounts,
    init containers, and each adapter's folder as the pod sees it."""

    paths: Mapping[str, str] = field(default_factory=dict)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def lora_options(md: ModelDeployment) -> contract.LoraOptions | None:
    """The workers' ``--enable-lora`` flags, or None without ``spec.lora``."""
    if md.lora is None:
        return None
    return contract.LoraOptions(
        max_loras_per_batch=md.lora.max_loras_per_batch,
        max_lora_rank=md.lora.max_lora_rank,
        target_modules=tuple(md.lora.target_modules),
    )


def _read_only(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "mountPath": path, "readOnly": True}


def _fetch(md: ModelDeployment, index: int, adapter: LoraAdapter) -> dict[str, Any]:
    """An init container downloading one Hub adapter (the base model's ``hf download``)."""
    source = adapter.source
    env: list[dict[str, Any]] = [{"name": HF_HOME_ENV, "value": f"{CACHE_DIR}/huggingface"}]
    if source.hf_token is not None:
        env.append(secret_env("HF_TOKEN", source.hf_token))
    return {
        "name": f"fetch-lora-{index}",
        "image": md.image,
        "imagePullPolicy": md.image_pull_policy,
        "command": [
            "hf",
            "download",
            source.hf_id,
            "--revision",
            source.hf_revision,
            "--local-dir",
            f"{HF_ADAPTERS_DIR}/{adapter.name}",
        ],
        "env": env,
        "securityContext": container_security_context(),
        "volumeMounts": [
            {"name": HF_VOLUME, "mountPath": HF_ADAPTERS_DIR},
            {"name": "cache", "mountPath": CACHE_DIR},
        ],
    }


def cluster_adapter_storage(md: ModelDeployment) -> AdapterStorage:
    """Volumes, mounts and init containers of a worker pod for ``spec.lora.adapters``."""
    if md.lora is None:
        return AdapterStorage()
    adapters = md.lora.adapters
    paths: dict[str, str] = {}
    claims = sorted({a.source.claim_name for a in adapters if a.source.source == "pvc"})
    folders = sorted(
        {posixpath.dirname(a.source.host_path) for a in adapters if a.source.source == "hostPath"}
    )
    storage = AdapterStorage(paths=paths)
    for i, claim in enumerate(claims):
        volume = {"claimName": claim, "readOnly": True}
        storage.volumes.append({"name": f"lora-pvc-{i}", "persistentVolumeClaim": volume})
        storage.mounts.append(_read_only(f"lora-pvc-{i}", f"{ADAPTERS_DIR}/pvc/{claim}"))
    for i, folder in enumerate(folders):
        volume = {"path": folder, "type": "Directory"}
        storage.volumes.append({"name": f"lora-host-{i}", "hostPath": volume})
        storage.mounts.append(_read_only(f"lora-host-{i}", folder))
    hub = [a for a in adapters if a.source.source == "huggingFace"]
    if hub:
        storage.volumes.append(empty_dir(HF_VOLUME))
        storage.mounts.append(_read_only(HF_VOLUME, HF_ADAPTERS_DIR))
        storage.init_containers.extend(_fetch(md, i, a) for i, a in enumerate(hub))
    for adapter in adapters:
        source = adapter.source
        if source.source == "pvc":
            inside = f"{ADAPTERS_DIR}/pvc/{source.claim_name}/{source.claim_path}"
            paths[adapter.name] = inside.rstrip("/")
        elif source.source == "hostPath":
            paths[adapter.name] = source.host_path
        else:
            paths[adapter.name] = f"{HF_ADAPTERS_DIR}/{adapter.name}"
    return storage


def local_adapter_paths(md: ModelDeployment) -> dict[str, str]:
    """``kvflow up``'s adapters: each ``hostPath`` adapter at its own folder (the other
    sources are refused there)."""
    adapters = md.lora.adapters if md.lora is not None else ()
    return {a.name: a.source.host_path for a in adapters if a.source.source == "hostPath"}


def adapter_annotation(md: ModelDeployment) -> str | None:
    """The :data:`contract.LORA_ADAPTERS_ANNOTATION` value every worker pod should carry
    (empty with ``spec.lora`` and no adapters: the router unloads what is there); None
    without ``spec.lora`` (the router then leaves the pods' adapters alone)."""
    if md.lora is None:
        return None
    return contract.format_lora_adapters(cluster_adapter_storage(md).paths)


def pods_to_annotate(md: ModelDeployment, pods: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(pod name, annotation value) for each of ``md``'s running worker pods whose
    :data:`contract.LORA_ADAPTERS_ANNOTATION` is not the spec's list yet."""
    wanted = adapter_annotation(md)
    if wanted is None:
        return []
    roles = {worker.role for worker in md.workers}
    stale = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        role = (meta.get("labels") or {}).get(contract.ROLE_LABEL)
        current = (meta.get("annotations") or {}).get(contract.LORA_ADAPTERS_ANNOTATION)
        if role in roles and not meta.get("deletionTimestamp") and current != wanted:
            stale.append((str(meta["name"]), wanted))
    return stale
