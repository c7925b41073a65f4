"""containerd for a real node: its own config, directories and socket; CRI on loopback."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ..process import Component
from .capability import CNI_BIN_DIR
from .config import RealNodeConfig
from .podnet import in_netns, write_pod_network

__all__ = [
    "CRI_NAMESPACE",
    "PAUSE_IMAGE",
    "containerd_component",
    "ctr",
    "write_containerd_config",
]

# The containerd namespace the CRI plugin (and so the kubelet) uses.
CRI_NAMESPACE = "k8s.io"
PAUSE_IMAGE = "localhost/kvflow/pause:local"


def write_containerd_config(cfg: RealNodeConfig) -> Path:
    """Write containerd's config and the loopback-only CNI network; return the config path.

    - `restrict_oom_score_adj`: root here may lack CAP_SYS_RESOURCE, and without it every
      sandbox fails with "can't get final child's PID from pipe: EOF".
    - The CRI streaming server (logs/exec/port-forward) binds 127.0.0.1 on a free port.
    - No AppArmor, no hugetlb controller; cgroupfs (no systemd) for runc.
    - Pods without host networking get a network namespace holding only `lo`, or in
      pod-network mode an address on the node namespace's bridge (`podnet`).
    """
    root = cfg.containerd_dir
    for sub in ("root", "state", "runc"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    cfg.cni_dir.mkdir(parents=True, exist_ok=True)
    if cfg.pod_network is not None:
        write_pod_network(cfg, cfg.pod_network)
    else:
        (cfg.cni_dir / "10-loopback.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "0.4.0",
                    "name": "kvflow-loopback",
                    "plugins": [{"type": "loopback"}],
                }
            )
        )
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    text = f"""version = 2
root = "{root / "root"}"
state = "{root / "state"}"
[grpc]
  address = "{cfg.containerd_socket}"
[ttrpc]
  address = "{cfg.containerd_socket}.ttrpc"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  disable_apparmor = true
  restrict_oom_score_adj = true
  tolerate_missing_hugetlb_controller = true
  disable_hugetlb_controller = true
  [{cri}.cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cfg.cni_dir}"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{root / "runc"}"
"""
    cfg.containerd_config.write_text(text)
    return cfg.containerd_config


def ctr(
    cfg: RealNodeConfig, *args: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`ctr` against this node's containerd, in the CRI namespace."""
    return subprocess.run(
        ctr_argv(cfg, *args), capture_output=True, text=True, check=check, timeout=timeout
    )


def ctr_argv(cfg: RealNodeConfig, *args: str) -> list[str]:
    """The command line of `ctr *args` against this node's containerd (CRI namespace)."""
    return ["ctr", "--address", str(cfg.containerd_socket), "-n", CRI_NAMESPACE, *args]


def containerd_component(cfg: RealNodeConfig) -> Component:
    """containerd as a component, healthy once `ctr version` reaches its socket."""
    config = write_containerd_config(cfg)

    def healthy() -> bool:
        if not cfg.containerd_socket.exists():
            return False
        return ctr(cfg, "version", check=False, timeout=10).returncode == 0

    argv = ["containerd", "--config", str(config)]
    return Component(
        "containerd",
        argv if cfg.pod_network is None else in_netns(cfg, argv),
        cfg.logs_dir / "containerd.log",
        healthy,
    )
