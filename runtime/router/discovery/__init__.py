"""Where the router's workers come from: static URLs or the Kubernetes API."""

from kvflow.runtime.router.discovery.base import WorkerSink, WorkerSpec

__all__ = ["WorkerSink", "WorkerSpec"]
