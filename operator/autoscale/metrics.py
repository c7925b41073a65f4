"""The autoscaler's Prometheus collectors (``kvflow_autoscaler_*``), served by the operator
on ``--metrics-port``. Each series carries the ModelDeployment's ``namespace`` and
``deployment`` and the ``role``; the operator's PodMonitor keeps them (``honorLabels``)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge

from .decision import Decision, ScalePolicy
from .signals import RoleSignals

__all__ = ["METRIC_NAMES", "AutoscalerMetrics"]

METRIC_NAMES = {
    "kvflow_autoscaler_desired_replicas": "replicas the autoscaler asks for, per role",
    "kvflow_autoscaler_current_replicas": "replicas of the role's Deployment when decided",
    "kvflow_autoscaler_ready_replicas": "Ready pods of the role",
    "kvflow_autoscaler_reporting_pods": "Ready pods with fresh metrics",
    "kvflow_autoscaler_decisions_total": "decisions, by direction (up, down, hold)",
    "kvflow_autoscaler_signal": "the signal the rule read, by signal (queue, running, kv, ttft, itl)",
    "kvflow_autoscaler_target": "the role's target for each signal",
}
_LABELS = ["namespace", "deployment", "role"]


class AutoscalerMetrics:
    """Every collector the autoscaler updates, in its own registry."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()

        def gauge(name: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, METRIC_NAMES[name], [*_LABELS, *extra], registry=r)

        self.desired = gauge("kvflow_autoscaler_desired_replicas")
        self.current = gauge("kvflow_autoscaler_current_replicas")
        self.ready = gauge("kvflow_autoscaler_ready_replicas")
        self.reporting = gauge("kvflow_autoscaler_reporting_pods")
        self.signal = gauge("kvflow_autoscaler_signal", ("signal",))
        self.target = gauge("kvflow_autoscaler_target", ("signal",))
        self.decisions = Counter(
            "kvflow_autoscaler_decisions",
            METRIC_NAMES["kvflow_autoscaler_decisions_total"],
            [*_LABELS, "direction"],
            registry=r,
        )

    def observe(
        self,
        key: tuple[str, str, str],
        policy: ScalePolicy,
        signals: RoleSignals,
        current: int,
        decision: Decision,
    ) -> None:
        """Record one decision of role ``key`` = (namespace, deployment, role)."""
        self.desired.labels(*key).set(decision.replicas)
        self.current.labels(*key).set(current)
        self.ready.labels(*key).set(signals.ready)
        self.reporting.labels(*key).set(signals.reporting)
        for direction in ("up", "down", "hold"):
            self.decisions.labels(*key, direction)  # every series exists from the start
        self.decisions.labels(*key, decision.direction).inc()
        measured = {
            "queue": signals.queue_per_replica,
            "running": signals.running_per_replica,
            "kv": signals.kv_usage,
            "ttft": signals.ttft_p90_s,
            "itl": signals.itl_p90_s,
        }
        targets = {
            "queue": policy.queue_per_replica,
            "running": policy.running_per_replica,
            "kv": policy.kv_usage,
            "ttft": policy.ttft_s,
            "itl": policy.itl_s,
        }
        for name, value in measured.items():
            if value is not None and signals.reporting:
                self.signal.labels(*key, name).set(value)
            target = targets[name]
            if target is not None:
                self.target.labels(*key, name).set(target)

    def forget(self, key: tuple[str, str, str]) -> None:
        """Drop a role that is no longer autoscaled."""
        for gauge in (self.desired, self.current, self.ready, self.reporting):
            with contextlib.suppress(KeyError):
                gauge.remove(*key)
