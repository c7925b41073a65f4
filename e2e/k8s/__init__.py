"""A real Kubernetes control plane for kvflow's end-to-end tests and `make cluster`.

`resolve_binaries()` finds or builds etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kwok, kubectl and helm at the versions pinned in `versions.py`;
`ControlPlane` runs them as local processes on loopback with kwok-simulated nodes
and hands out a `Kube` (kubeconfig, env, kubectl/helm runners, `wait_for`).
"""

from .bins import BINARIES, Binaries, BinaryResolutionError, resolve_binaries
from .client import CommandError, Kube
from .config import ControlPlaneConfig, FakeNodeSpec
from .controlplane import ControlPlane
from .env import K8sEnv
from .nodes import GPU_RESOURCE
from .process import ComponentError
from .versions import PINNED, K8sVersions

__all__ = [
    "BINARIES",
    "GPU_RESOURCE",
    "PINNED",
    "Binaries",
    "BinaryResolutionError",
    "CommandError",
    "ComponentError",
    "ControlPlane",
    "ControlPlaneConfig",
    "FakeNodeSpec",
    "K8sEnv",
    "K8sVersions",
    "Kube",
    "resolve_binaries",
]
