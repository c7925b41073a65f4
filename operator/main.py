"""``kvflow operator``: run the ModelDeployment operator against the current cluster.

Credentials come from the in-cluster service account, else from ``$KUBECONFIG`` /
``~/.kube/config``. The liveness endpoint (kopf's) answers on
``http://<health-host>:<health-port>`` + :data:`contract.OPERATOR_HEALTH_PATH`.
"""

from __future__ import annotations

import argparse
import logging
import os

import kopf
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from kvflow import contract

from .handlers import register
from .kube import Cluster


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow operator", description=__doc__.splitlines()[0])
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch this namespace (repeatable); default: all namespaces",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--health-host", default="0.0.0.0", help="address of the liveness endpoint")
    parser.add_argument(
        "--health-port",
        type=int,
        default=contract.OPERATOR_HEALTH_PORT,
        help="port of the liveness endpoint (0 disables it)",
    )
    parser.add_argument(
        "--drift-interval",
        type=float,
        default=30.0,
        help="seconds between full reconciles of each ModelDeployment",
    )
    parser.add_argument("--workers", type=int, default=4, help="threads running reconciles")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every event")
    return parser


def _api_client() -> k8s.ApiClient:
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config()
    else:
        k8s_config.load_kube_config()
    return k8s.ApiClient()


def settings_for(args: argparse.Namespace) -> kopf.OperatorSettings:
    """kopf settings: state in kvflow.dev annotations (the CRD's status schema has no room
    for kopf's own fields), warnings-only Kubernetes Events, a bounded thread pool."""
    settings = kopf.OperatorSettings()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvflow.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kvflow.dev")
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = args.workers
    settings.peering.standalone = True
    settings.watching.server_timeout = 300
    return settings


class _QuietChildEvents(logging.Filter):
    """Drops kopf's per-event "Handler 'child-...' succeeded" lines (one per child status
    change); the operator logs what it repairs itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Handler 'child-")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    kopf.configure(verbose=args.verbose)
    if not args.verbose:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_QuietChildEvents())
    registry = kopf.OperatorRegistry()
    register(registry, Cluster(_api_client()), args.namespace, args.drift_interval)
    liveness = None
    if args.health_port:
        liveness = f"http://{args.health_host}:{args.health_port}{contract.OPERATOR_HEALTH_PATH}"
    kopf.run(
        registry=registry,
        settings=settings_for(args),
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
    )
    return 0
