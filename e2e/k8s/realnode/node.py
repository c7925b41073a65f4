"""A real node: containerd and a kubelet on this machine, registered with a control plane."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ..client import Kube
from ..env import K8sEnv
from ..log import elapsed, say
from ..nodes import node_is_ready
from ..ports import free_ports
from ..process import Component, ComponentError
from ..versions import PINNED, K8sVersions
from .capability import missing_capability
from .cgroups import create_cgroup_root, kill_cgroup_processes, remove_cgroup_root
from .config import NodePorts, RealNodeConfig
from .containerd import containerd_component
from .dns import coredns_component, kube_dns_service
from .images import build_host_base, build_pause, kubernetes_module_dir
from .kubelet import kubelet_component
from .podnet import (
    create_netns,
    delete_netns,
    node_relay_rules,
    pod_network_missing,
    relay_component,
)
from .relay import Endpoint, Rule
from .teardown import kill_shims, mounts_under, sandbox_netns_paths, unmount_under

__all__ = ["NodeUnavailable", "RealNode"]


# What one node's containerd takes once the CPU runtime image is imported (its ~3 GB of
# compressed layers and their unpacked snapshots), with room to spare. A CI run on a
# nearly full disk failed 35 minutes in with "no space left on device" inside `ctr`.
MIN_FREE_BYTES = 12 * 2**30


class NodeUnavailable(RuntimeError):
    """This machine cannot run a real node; the message says what is missing."""


def check_free_space(path: Path, need: int = MIN_FREE_BYTES) -> None:
    """Raise `RuntimeError` (a failure, not a skip: the disk is the machine's state, not a
    missing capability) unless the file system holding `path` has `need` bytes free."""
    free = shutil.disk_usage(path).free
    if free < need:
        raise RuntimeError(
            f"a real node needs {need / 2**30:.0f} GiB free for its images under {path}; "
            f"the disk has {free / 2**30:.1f} GiB (free space, e.g. old test directories)"
        )


class RealNode:
    """containerd + kubelet registered as `config.name`, with the pause and host base
    images imported, its InternalIP set to 127.0.0.1 and Ready.

    With `config.pod_network` both run in a network namespace the node creates, pods get
    addresses on a bridge there, relays join it to root loopback (`podnet`), and CoreDNS
    (`coredns`, required then) answers the pods' cluster names (`dns`); `forward()` makes
    a pod address reachable from a root loopback port.

    `start()` wipes `config.state_dir`; on failure it tears down what it started and
    raises (`NodeUnavailable` when the machine lacks a capability, else
    `ComponentError`). `stop()` leaves nothing behind: it stops the kubelet, kills
    every container process (found through the node's cgroup subtree), stops
    containerd and its shims, unmounts everything under the state dir and the pods'
    network namespaces, removes the cgroups and deletes the Node object.
    """

    def __init__(
        self,
        kubelet: Path,
        config: RealNodeConfig,
        kube: Kube,
        client_ca: Path,
        env: K8sEnv | None = None,
        versions: K8sVersions = PINNED,
        coredns: Path | None = None,
    ) -> None:
        if config.pod_network is not None and coredns is None:
            raise ValueError(f"{config.name} has a pod network: its DNS needs a coredns binary")
        self.config = config
        self._kubelet_bin = kubelet
        self._coredns_bin = coredns
        self._kube = kube
        self._client_ca = client_ca
        self._env = env or K8sEnv.from_environ()
        self._versions = versions
        self._containerd: Component | None = None
        self._kubelet: Component | None = None
        self._cgroup_created = False
        self._netns_created = False
        self._relays: list[Component] = []
        self._dns: Component | None = None

    @property
    def components(self) -> list[Component]:
        own = [c for c in (self._containerd, self._kubelet, self._dns) if c is not None]
        return [*own, *self._relays]

    def start(self) -> RealNode:
        cfg = self.config
        reason = missing_capability()
        if reason is None and cfg.pod_network is not None:
            reason = pod_network_missing()
        if reason:
            raise NodeUnavailable(reason)
        begin = time.monotonic()
        try:
            shutil.rmtree(cfg.state_dir, ignore_errors=True)
            cfg.logs_dir.mkdir(parents=True)
            check_free_space(cfg.state_dir)
            create_cgroup_root(cfg.cgroup_root)
            self._cgroup_created = True
            ports = NodePorts(*free_ports(3))
            if cfg.pod_network is not None:
                self._start_netns(ports)
            self._containerd = self._launch(containerd_component(cfg))
            build_pause(cfg, kubernetes_module_dir(self._env, self._versions))
            build_host_base(cfg)
            kubelet = kubelet_component(
                self._kubelet_bin, cfg, ports, self._kube.kubeconfig, self._client_ca
            )
            self._kubelet = self._launch(kubelet)
            self._register()
        except BaseException:
            self.stop()
            raise
        say(f"real node {cfg.name} Ready in {elapsed(begin)} (state: {cfg.state_dir})")
        return self

    def _start_netns(self, ports: NodePorts) -> None:
        cfg, net = self.config, self.config.pod_network
        assert net is not None
        try:
            create_netns(cfg, net)
        except RuntimeError as err:
            raise NodeUnavailable(f"cannot create a network namespace: {err}") from err
        self._netns_created = True
        rules = node_relay_rules(cfg, net, ports, self._kube.kubeconfig)
        self._relays.append(self._launch(relay_component("relay-node", rules, cfg.logs_dir)))
        assert self._coredns_bin is not None
        self._kube.apply([kube_dns_service(net)])
        dns = coredns_component(self._coredns_bin, cfg, self._kube.kubeconfig, ports.dns_ready)
        self._dns = self._launch(dns)

    def forward(self, host: str, port: int) -> int:
        """A root loopback port relayed to `host:port` inside the node's namespace (a pod
        address); the relay lives until the node stops. Pod-network mode only."""
        if self.config.pod_network is None:
            raise RuntimeError(f"{self.config.name} has no pod network: pods use loopback")
        (local,) = free_ports(1)
        rule = Rule(Endpoint("127.0.0.1", local), Endpoint(host, port, self.config.netns_path))
        name = f"relay-{local}-to-{host}-{port}"
        self._relays.append(self._launch(relay_component(name, [rule], self.config.logs_dir)))
        return local

    def check_running(self) -> None:
        for component in self.components:
            component.check_running()

    def stop(self) -> None:
        cfg = self.config
        if self._kubelet is not None:
            self._kubelet.stop()
            self._kubelet = None
        netns: list[Path] = []
        if self._containerd is not None:
            try:
                netns = sandbox_netns_paths(cfg)
            except Exception as err:  # a dead containerd: the mounts are found anyway
                say(f"could not list {cfg.name}'s sandboxes: {err}")
        if self._cgroup_created:
            kill_cgroup_processes(cfg.cgroup_root)
        if self._containerd is not None:
            self._containerd.stop()
            self._containerd = None
        kill_shims(cfg)
        unmount_under(cfg.state_dir, *netns)
        for path in netns:
            path.unlink(missing_ok=True)
        # containerd's root holds the imported images and their unpacked snapshots (about
        # 10 GB with the CPU runtime image): gone with the node; its logs stay. Only when
        # nothing is mounted below the state any more (rmtree would follow a bind mount).
        if not mounts_under(cfg.state_dir):
            shutil.rmtree(cfg.containerd_dir / "root", ignore_errors=True)
        if self._cgroup_created:
            remove_cgroup_root(cfg.cgroup_root)
            self._cgroup_created = False
        if self._dns is not None:
            self._dns.stop()
            self._dns = None
        while self._relays:
            self._relays.pop().stop()
        if self._netns_created:
            delete_netns(cfg)
            self._netns_created = False
        self._kube.kubectl("delete", "node", cfg.name, "--wait=false", check=False, timeout=20)

    def _launch(self, component: Component) -> Component:
        say(f"starting {component.name} (log: {component.log_path})")
        component.start()
        try:
            component.wait_healthy(self.config.ready_timeout_s)
        except BaseException:
            component.stop()
            raise
        return component

    def _register(self) -> None:
        """Wait for the Node object, give it 127.0.0.1 as InternalIP (the kubelet refuses
        to report a loopback node IP), then wait until it is Ready."""
        cfg, kube = self.config, self._kube

        def registered() -> bool:
            self.check_running()
            return kube.kubectl("get", "node", cfg.name, check=False).returncode == 0

        def ready() -> bool:
            self.check_running()
            return node_is_ready(kube.get_json("node", cfg.name))

        try:
            kube.wait_for(registered, cfg.ready_timeout_s, what=f"node {cfg.name} to register")
            addresses = {"status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}]}}
            kube.kubectl(
                "patch", "node", cfg.name, "--subresource=status", "--type=merge",
                "-p", json.dumps(addresses),
            )  # fmt: skip
            kube.wait_for(ready, cfg.ready_timeout_s, what=f"node {cfg.name} to be Ready")
        except TimeoutError as err:
            tails = "\n".join(f"--- {c.name}\n{c.log_tail(20)}" for c in self.components)
            raise ComponentError(f"{err}; logs:\n{tails}") from err
