"""A real Kubernetes control plane as local processes on loopback."""

from __future__ import annotations

import fcntl
import shutil
import time
from pathlib import Path
from types import TracebackType
from typing import IO

from .bins import Binaries
from .certs import Pki, make_pki
from .client import Kube
from .components import FAKE_NODE_ANNOTATION, control_plane_components
from .config import ControlPlaneConfig, Ports
from .kubeconfig import write_kubeconfig
from .log import elapsed, say
from .lws import LwsController
from .nodes import fake_node, node_is_ready, write_kwok_config
from .ports import free_ports
from .process import Component, ComponentError
from .realnode import RealNode, RealNodeConfig

__all__ = ["ControlPlane"]


class ControlPlane:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok, plus
    `config.node_count` fake nodes that kwok keeps Ready.

    `start()` wipes `config.state_dir`, so every start is a fresh cluster; it returns
    once the nodes are Ready and the `default` ServiceAccount exists (pods can be
    admitted), or stops what it started and raises `ComponentError` with the
    failing component's log tail. `stop()` terminates and reaps every component,
    newest first. As a context manager it starts on enter and stops on exit.
    """

    def __init__(self, binaries: Binaries, config: ControlPlaneConfig) -> None:
        self.binaries = binaries
        self.config = config
        self._started: list[Component] = []
        self._real_nodes: list[RealNode] = []
        self._lws: list[LwsController] = []
        self._kube: Kube | None = None
        self._lock: IO[str] | None = None

    @property
    def kube(self) -> Kube:
        if self._kube is None:
            raise RuntimeError("the control plane is not running")
        return self._kube

    @property
    def components(self) -> list[Component]:
        return list(self._started)

    def start(self) -> ControlPlane:
        cfg = self.config
        begin = time.monotonic()
        self._lock_state_dir()
        try:
            shutil.rmtree(cfg.state_dir, ignore_errors=True)
            cfg.state_dir.mkdir(parents=True)
            pki = make_pki(cfg.pki_dir, cfg.service_ip)
            ports = Ports(*free_ports(6))
            write_kubeconfig(cfg.kubeconfig, f"https://127.0.0.1:{ports.apiserver}", pki)
            write_kwok_config(cfg.kwok_config)
            api_tier, controllers = control_plane_components(self.binaries, cfg, ports, pki)
            for component in api_tier:
                self._launch([component])
            self._launch(controllers)
            self._kube = Kube.connect(cfg.kubeconfig, self.binaries, cfg.helm_dir)
            self._add_fake_nodes()
        except BaseException:
            self.stop()
            raise
        say(f"control plane up in {elapsed(begin)}; KUBECONFIG={cfg.kubeconfig}")
        return self

    def add_real_node(self, kubelet: Path, name: str = "real-node", taint: bool = True) -> RealNode:
        """Start a real node (containerd + `kubelet`) in `<state_dir>/nodes/<name>` and
        wait until it is Ready; `stop()` tears it down before the control plane.
        Raises `realnode.NodeUnavailable` when this machine cannot run one."""
        config = RealNodeConfig(self.config.state_dir / "nodes" / name, name=name, taint=taint)
        node = RealNode(kubelet, config, self.kube, self.config.pki_dir / "ca.crt")
        node.start()
        self._real_nodes.append(node)
        return node

    def start_lws(self, binaries: Binaries) -> LwsController:
        """Install LeaderWorkerSet's CRD and run its controller and webhooks (`binaries`:
        `bins.LWS_BINARIES`, resolved apart: only tests that use LWS build it); `stop()`
        stops it first."""
        pki = Pki(self.config.pki_dir)
        lws = LwsController(binaries, self.kube, pki, self.config.state_dir / "lws").start()
        self._lws.append(lws)
        return lws

    def remove_real_node(self, node: RealNode) -> None:
        """Stop one real node (see `RealNode.stop`) while the control plane keeps running."""
        if node in self._real_nodes:
            self._real_nodes.remove(node)
        node.stop()

    def check_running(self) -> None:
        """Raise `ComponentError` if any component (real nodes' included) has exited."""
        for component in self._started:
            component.check_running()
        for node in self._real_nodes:
            node.check_running()
        for lws in self._lws:
            lws.check_running()

    def stop(self) -> None:
        while self._lws:
            self._lws.pop().stop()
        while self._real_nodes:
            self._real_nodes.pop().stop()
        while self._started:
            self._started.pop().stop()
        self._kube = None
        if self._lock is not None:
            self._lock.close()  # closing releases the flock
            self._lock = None

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _lock_state_dir(self) -> None:
        """Hold `<state_dir>.lock` while running: a second control plane on the same
        state dir would wipe this one's etcd data and certificates."""
        state_dir = self.config.state_dir
        state_dir.parent.mkdir(parents=True, exist_ok=True)
        lock = open(state_dir.with_name(state_dir.name + ".lock"), "w")  # noqa: SIM115
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise ComponentError(f"another control plane is running on {state_dir}") from None
        self._lock = lock

    def _launch(self, components: list[Component]) -> None:
        """Start `components` together, then wait for each to become healthy."""
        for component in components:
            say(f"starting {component.name} (log: {component.log_path})")
            component.start()
            self._started.append(component)
        for component in components:
            component.wait_healthy(self.config.ready_timeout_s)

    def _add_fake_nodes(self) -> None:
        cfg, kube = self.config, self.kube
        names = [f"kwok-node-{i}" for i in range(cfg.node_count)]
        if names:
            kube.apply([fake_node(n, cfg.node, FAKE_NODE_ANNOTATION) for n in names])

        def nodes_ready() -> bool:
            self.check_running()
            items = kube.get_json("nodes")["items"]
            ready = {n["metadata"]["name"] for n in items if node_is_ready(n)}
            return ready >= set(names)

        def default_service_account() -> bool:
            self.check_running()
            return kube.kubectl("get", "serviceaccount", "default", check=False).returncode == 0

        try:
            kube.wait_for(nodes_ready, cfg.ready_timeout_s, what="the fake nodes to be Ready")
            kube.wait_for(
                default_service_account, cfg.ready_timeout_s, what="the default ServiceAccount"
            )
        except TimeoutError as err:
            tails = "\n".join(f"--- {c.name}\n{c.log_tail(15)}" for c in self._started[2:])
            raise ComponentError(f"{err}; controller logs:\n{tails}") from err
