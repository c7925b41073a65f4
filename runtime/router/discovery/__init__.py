"""Where the router's workers come from: static URLs or the Kubernetes API."""

from kvflow.runtime.router.discovery.base import WorkerSink, WorkerSpec
from kvflow.runtime.router.discovery.kube import KubeDiscovery
from kvflow.runtime.router.discovery.pods import PodWorkers, worker_spec_from_pod

__all__ = ["KubeDiscovery", "PodWorkers", "WorkerSink", "WorkerSpec", "worker_spec_from_pod"]
