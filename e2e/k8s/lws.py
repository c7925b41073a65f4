"""LeaderWorkerSet's controller (sigs.k8s.io/lws) beside a local control plane.

The controller runs as a local process with its internal cert management off: it serves
its webhooks on loopback with a cert the cluster's CA signs (`certs.make_serving_cert`),
and the webhook configurations point the API server at that URL. Its pod webhook (which
gives each group's pods `LWS_LEADER_ADDRESS`, `LWS_WORKER_INDEX` and `LWS_GROUP_SIZE`)
only sees pods that carry LWS's name label, so the rest of the cluster does not depend on
the controller being up.
"""

from __future__ import annotations

import base64
import socket
from pathlib import Path
from typing import Any

import yaml

from .bins import Binaries
from .bins.lws import LWS_CONTROLLER, LWS_CRD
from .certs import Pki, make_serving_cert
from .client import Kube
from .health import http_probe
from .log import say
from .ports import free_ports
from .process import Component

__all__ = ["LWS_CRD_NAME", "LwsController", "webhook_configurations"]

LWS_CRD_NAME = "leaderworkersets.leaderworkerset.x-k8s.io"
_POD_SELECTOR = {
    "matchExpressions": [{"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]
}
# (name, path, group, resource, operations) of LWS's config/webhook/manifests.yaml at v0.7.0
_MUTATING = (
    ("mleaderworkerset.kb.io", "/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
     "leaderworkerset.x-k8s.io", "leaderworkersets", ["CREATE", "UPDATE"]),
    ("mpod.kb.io", "/mutate--v1-pod", "", "pods", ["CREATE"]),
)  # fmt: skip
_VALIDATING = (
    ("vleaderworkerset.kb.io", "/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
     "leaderworkerset.x-k8s.io", "leaderworkersets", ["CREATE", "UPDATE"]),
    ("vpod.kb.io", "/validate--v1-pod", "", "pods", ["CREATE", "UPDATE"]),
)  # fmt: skip
_CONFIG_NAME = "kvflow-lws"  # both webhook configurations'


class LwsController:
    """`start()` installs LWS's CRD, starts the controller and registers its webhooks;
    `stop()` unregisters them and stops it. State lives under `state_dir`."""

    def __init__(self, binaries: Binaries, kube: Kube, pki: Pki, state_dir: Path) -> None:
        self._binaries = binaries
        self._kube = kube
        self._pki = pki
        self._dir = state_dir
        self._component: Component | None = None

    def start(self) -> LwsController:
        webhook, health = free_ports(2)
        certs = make_serving_cert(self._pki, "lws-webhook", self._dir / "certs")
        config = self._dir / "config.yaml"
        config.write_text(yaml.safe_dump(_config(webhook, health, certs)))
        # NOTE: webhooks first: a LeaderWorkerSet or pod admitted before they are
        # registered would miss LWS's defaults, labels and env for good; until the
        # controller serves them, such requests fail (failurePolicy Fail) and are retried.
        self._kube.apply(webhook_configurations(webhook, self._pki.ca_crt.read_bytes()))
        self._kube.kubectl("apply", "--server-side", "-f", str(self._binaries[LWS_CRD]))
        self._kube.wait_for(self._crd_established, 30, 0.2, "the LeaderWorkerSet CRD")
        component = Component(
            LWS_CONTROLLER,
            [str(self._binaries[LWS_CONTROLLER]), f"--config={config}", "--zap-log-level=info"],
            self._dir / "lws-controller.log",
            lambda: http_probe(f"http://127.0.0.1:{health}/readyz")() and _listens(webhook),
        )
        say(f"starting {LWS_CONTROLLER} (log: {component.log_path})")
        component.start(self._kube.env)
        self._component = component
        component.wait_healthy(60)
        return self

    def stop(self) -> None:
        for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
            self._kube.kubectl("delete", kind, _CONFIG_NAME, "--ignore-not-found", check=False)
        if self._component is not None:
            self._component.stop()
            self._component = None

    def check_running(self) -> None:
        if self._component is not None:
            self._component.check_running()

    def log_tail(self, lines: int = 40) -> str:
        return self._component.log_tail(lines) if self._component else "(not started)"

    def _crd_established(self) -> bool:
        crd = self._kube.get_json("crd", LWS_CRD_NAME)
        conditions = (crd.get("status") or {}).get("conditions") or ()
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def _listens(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _config(webhook: int, health: int, certs: Path) -> dict[str, Any]:
    """LWS's Configuration (config.lws.x-k8s.io/v1alpha1): no leader election, no cert
    rotation (the certs are given), metrics off, webhooks and probes on loopback."""
    return {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook, "certDir": str(certs)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
    }


def webhook_configurations(port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """LWS's webhook configurations (its config/webhook/manifests.yaml) calling the
    controller at `https://127.0.0.1:<port>`, trusting `ca_pem`; pod hooks only for LWS's."""
    bundle = base64.b64encode(ca_pem).decode()

    def hooks(table: tuple[tuple[str, str, str, str, list[str]], ...]) -> list[dict[str, Any]]:
        out = []
        for name, path, group, resource, operations in table:
            hook: dict[str, Any] = {
                "name": name,
                "admissionReviewVersions": ["v1"],
                "clientConfig": {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "rules": [
                    {
                        "apiGroups": [group],
                        "apiVersions": ["v1"],
                        "operations": operations,
                        "resources": [resource],
                    }
                ],
            }
            if resource == "pods":
                hook["objectSelector"] = _POD_SELECTOR
            out.append(hook)
        return out

    api = "admissionregistration.k8s.io/v1"
    return [
        {
            "apiVersion": api,
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": _CONFIG_NAME},
            "webhooks": hooks(_MUTATING),
        },
        {
            "apiVersion": api,
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": _CONFIG_NAME},
            "webhooks": hooks(_VALIDATING),
        },
    ]
