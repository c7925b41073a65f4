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
from prometheus_client import start_http_server

from kvflow import contract

from .autoscale.metrics import AutoscalerMetrics
from .autoscale.scale import AutoscalerSettings
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
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address of /metrics")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help=f"port of the autoscaler's Prometheus /metrics (0, the default, disables it; "
        f"the chart uses {contract.OPERATOR_METRICS_PORT})",
    )
    auto = parser.add_argument_group("autoscaler (roles with autoscaling.enabled)")
    d = AutoscalerSettings()
    for flag, field, kind, text in (
        ("--autoscaler-interval", "interval_s", float, "seconds between decisions"),
        ("--autoscaler-scale-up-window", "scale_up_window_s", float, "seconds pressure must last before a scale-out"),
        ("--autoscaler-scale-up-cooldown", "scale_up_cooldown_s", float, "least seconds between scale-outs of a role"),
        ("--autoscaler-scale-down-cooldown", "scale_down_cooldown_s", float, "least seconds after any change before a scale-in"),
        ("--autoscaler-stale-after", "stale_s", float, "a pod whose newest metrics are older holds the size"),
        ("--autoscaler-gauge-window", "gauge_window_s", float, "seconds over which each pod's queue, running and KV usage gauges are averaged (0: the newest scrape alone)"),
        ("--autoscaler-prometheus-url", "prometheus_url", str, "read pod metrics from this Prometheus (series labelled namespace and pod, as a PodMonitor does) instead of scraping pods"),
    ):  # fmt: skip
        auto.add_argument(flag, dest=field, type=kind, default=getattr(d, field), help=text)
    return parser


def autoscaler_settings(args: argparse.Namespace) -> AutoscalerSettings:
    names = ("interval_s", "scale_up_window_s", "scale_up_cooldown_s", "scale_down_cooldown_s")
    values = {n: getattr(args, n) for n in (*names, "stale_s", "gauge_window_s", "prometheus_url")}
    return AutoscalerSettings(**values)


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
    metrics = AutoscalerMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)
    register(
        registry,
        Cluster(_api_client()),
        args.namespace,
        args.drift_interval,
        autoscaler_settings(args),
        metrics,
    )
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
