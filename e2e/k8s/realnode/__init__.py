"""A real node beside the kwok nodes: containerd, runc and a kubelet built with the other
components, on loopback, with images built here (pause from the Kubernetes source, a
host base image) and no registry.

`RealNode` runs one; `missing_capability()` says why this machine cannot (or None).
With a `PodNetwork` in its config the node runs in a network namespace of its own and
pods get addresses on a bridge there (`podnet`).
"""

from .capability import DEBIAN_PACKAGES, missing_capability
from .config import (
    POD_NETWORK_LABEL_VALUE,
    REAL_NODE_LABEL,
    REAL_NODE_TAINT,
    PodNetwork,
    RealNodeConfig,
)
from .containerd import PAUSE_IMAGE
from .hostpods import HostRuntime, api_server_env, real_node_placement
from .images import HOST_BASE_IMAGE
from .node import NodeUnavailable, RealNode

__all__ = [
    "DEBIAN_PACKAGES",
    "HOST_BASE_IMAGE",
    "PAUSE_IMAGE",
    "POD_NETWORK_LABEL_VALUE",
    "REAL_NODE_LABEL",
    "REAL_NODE_TAINT",
    "HostRuntime",
    "NodeUnavailable",
    "PodNetwork",
    "RealNode",
    "RealNodeConfig",
    "api_server_env",
    "missing_capability",
    "real_node_placement",
]
