"""The operator chart's values and a ModelDeployment adapted to run on the real node.

Shared by the e2e tests and `python -m e2e.k8s up --real-node` (which writes them for a
user to `helm install` and `kubectl apply`). The adaptation touches per-role pod settings
only: host networking on loopback ports, the host base image with this checkout, the
apiserver's loopback address for in-cluster clients, the real node's placement, and
resource requests the node's cores can hold.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

from .hostpods import HostRuntime, api_server_env, real_node_placement
from .images import HOST_BASE_IMAGE

__all__ = [
    "SEEDED_CACHE",
    "adapt_model_deployment",
    "adapt_to_pod_network",
    "operator_chart_values",
    "pod_network_chart_values",
    "seed_cache",
    "seed_embedded",
]

# Folders of the kvflow cache a seed directory may hold (`models/` with the converted
# embedded model, `cpu-kernels/` with the built native kernels).
SEEDED_CACHE = ("models", "cpu-kernels")
# Where the operator mounts the runtime pods' writable cache (kvflow.operator.paths).
_POD_CACHE_DIR = "/var/cache/kvflow"


def operator_chart_values(
    kubeconfig: Path,
    health_port: int,
    watch_namespaces: list[str] | None = None,
    host: HostRuntime | None = None,
) -> dict[str, Any]:
    """Values that run the chart's operator as a host-network pod on the real node, from
    the host base image with this checkout mounted."""
    host = host or HostRuntime.current()
    repository, tag = HOST_BASE_IMAGE.rsplit(":", 1)
    values: dict[str, Any] = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "hostNetwork": True,
        "health": {"host": "127.0.0.1", "port": health_port},
        "env": [*host.env(), *api_server_env(kubeconfig)],
        "extraVolumes": host.volumes(),
        "extraVolumeMounts": host.mounts(),
        **real_node_placement(),
    }
    if watch_namespaces:
        values["watchNamespaces"] = list(watch_namespaces)
    return values


def pod_network_chart_values(
    label_value: str,
    watch_namespaces: list[str] | None = None,
    host: HostRuntime | None = None,
) -> dict[str, Any]:
    """Values that run the chart's operator as a pod on a pod-network real node (the one
    labelled `label_value`), from the host base image with this checkout mounted. The
    pod has an address of its own: in-cluster settings reach the apiserver through the
    `kubernetes` ClusterIP the node serves, and the autoscaler scrapes pod addresses."""
    host = host or HostRuntime.current()
    repository, tag = HOST_BASE_IMAGE.rsplit(":", 1)
    values: dict[str, Any] = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "env": host.env(),
        "extraVolumes": host.volumes(),
        "extraVolumeMounts": host.mounts(),
        **real_node_placement(label_value),
    }
    if watch_namespaces:
        values["watchNamespaces"] = list(watch_namespaces)
    return values


def _role(
    host: HostRuntime | None,
    port: int | None,
    seed: Path | None,
    extra_env: list[dict[str, Any]],
    label_value: str = "true",
) -> dict[str, Any]:
    """A role's pod settings on the real node. `host` None: the role keeps the image the
    operator names by default (the runtime or router image, built and imported by the
    tests), with nothing of this machine mounted but the seed cache."""
    volumes = host.volumes() if host else []
    mounts = host.mounts() if host else []
    if seed is not None:
        # Read-only inside the operator's writable cache emptyDir: the runtime finds the
        # converted model and the built kernels where it would have written them.
        volumes.append({"name": "seed", "hostPath": {"path": str(seed), "type": "Directory"}})
        mounts += [
            {
                "name": "seed",
                "mountPath": f"{_POD_CACHE_DIR}/{sub}",
                "subPath": sub,
                "readOnly": True,
            }
            for sub in SEEDED_CACHE
            if (seed / sub).is_dir()
        ]
    role: dict[str, Any] = {
        "volumes": volumes,
        "volumeMounts": mounts,
        "env": [*(host.env() if host else []), *extra_env],
        **real_node_placement(label_value),
    }
    if host is not None:
        role["image"] = HOST_BASE_IMAGE
    if port is not None:  # host networking, on a loopback port of its own
        role.update(hostNetwork=True, ports={"http": port})
    return role


def adapt_model_deployment(
    body: dict[str, Any],
    kubeconfig: Path,
    router_port: int,
    worker_port: int,
    seed: Path | None = None,
    host: HostRuntime | None = None,
    images: bool = False,
) -> dict[str, Any]:
    """A copy of a unified ModelDeployment that runs on the real node: one worker
    replica (two host-network replicas would need one host port twice), the router on
    `router_port`, the worker on `worker_port`, optionally a seed cache directory. With
    `images` the pods run the operator's default runtime and router images (imported
    into the node's containerd), else the host base image with this checkout mounted."""
    host = None if images else host or HostRuntime.current()
    out = copy.deepcopy(body)
    spec = out["spec"]
    if spec.get("mode", "unified") != "unified":
        raise ValueError("only unified ModelDeployments are adapted to the real node")
    spec["imagePullPolicy"] = "Never"
    unified = spec.setdefault("unified", {})
    unified.update(replicas=1, **_role(host, worker_port, seed, []))
    unified.setdefault("resources", {}).setdefault("requests", {})["cpu"] = "250m"
    router = spec.setdefault("router", {})
    router.update(_role(host, router_port, None, api_server_env(kubeconfig)))
    router["resources"] = {"requests": {"cpu": "50m", "memory": "128Mi"}}
    return out


def adapt_to_pod_network(
    body: dict[str, Any],
    label_value: str,
    replicas: int,
    seed: Path | None = None,
    host: HostRuntime | None = None,
    images: bool = False,
) -> dict[str, Any]:
    """A copy of a unified ModelDeployment that runs on a pod-network real node (the one
    labelled `label_value`): pods keep their default ports on addresses of their own, so
    `replicas` workers share the node; the router finds them through the API and reaches
    the apiserver through the in-cluster settings the kubelet injects. `images`: as in
    :func:`adapt_model_deployment`."""
    host = None if images else host or HostRuntime.current()
    out = copy.deepcopy(body)
    spec = out["spec"]
    if spec.get("mode", "unified") != "unified":
        raise ValueError("only unified ModelDeployments are adapted to the real node")
    spec["imagePullPolicy"] = "Never"
    unified = spec.setdefault("unified", {})
    unified.update(replicas=replicas, **_role(host, None, seed, [], label_value))
    unified.setdefault("resources", {}).setdefault("requests", {})["cpu"] = "250m"
    router = spec.setdefault("router", {})
    router.update(_role(host, None, None, [], label_value))
    router["resources"] = {"requests": {"cpu": "50m", "memory": "128Mi"}}
    return out


def seed_cache(source: Path, target: Path, model: str) -> Path | None:
    """Copy `model`'s converted folder (`<source>/models/<model>`) and the built CPU kernels
    (`<source>/cpu-kernels`) into `target`, readable by the pods' user; None when the
    source holds no converted model (the pods then convert it themselves).

    Without a seed each runtime pod converts the GGUF at start: about 30 s of CPU, and
    with the example's 4Gi memory limit the container was OOM-killed on this machine.
    """
    converted = source / "models" / model
    if not (converted / ".kvflow-converted").is_file():
        return None
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(converted, target / "models" / model)
    if (source / "cpu-kernels").is_dir():
        shutil.copytree(source / "cpu-kernels", target / "cpu-kernels")
    for path in [target, *target.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
    return target


def seed_embedded(target: Path) -> Path:
    """A seed directory at `target` for the embedded model: the model converted and the
    native CPU kernels built here first when missing, then copied (:func:`seed_cache`)."""
    from kvflow.kernels.cpu.build import load_library
    from kvflow.runtime.env import cache_dir
    from kvflow.runtime.models.embedded import EMBEDDED_MODEL_NAME, embedded_model_path

    embedded_model_path()
    load_library()
    seeded = seed_cache(cache_dir(), target, EMBEDDED_MODEL_NAME)
    assert seeded is not None, "the embedded model was converted but left no marker"
    return seeded
