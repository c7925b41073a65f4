"""kvflow's request router (``kvflow router``): torch-free, cache-aware, PD pairing.

Pieces: discovery sources feed a :class:`WorkerRegistry` (health, breakers, load); an
:class:`AdapterSync` keeps managed workers' LoRA adapters loaded; a
:class:`Policy` from :data:`POLICIES` picks a worker; the :class:`Forwarder` sends, retries
before the first byte and relays the answer; ``app.create_app`` is the HTTP surface.
Nothing here imports torch, numpy, triton or transformers.
"""

from kvflow.runtime.router.adapter_sync import AdapterSync
from kvflow.runtime.router.config import (
    AdmissionConfig,
    BreakerConfig,
    CacheAwareConfig,
    HealthConfig,
    RetryConfig,
    RouterConfig,
)
from kvflow.runtime.router.metrics import METRIC_NAMES, RouterMetrics
from kvflow.runtime.router.policies import POLICIES, Policy, Selection
from kvflow.runtime.router.proxy import Forwarder
from kvflow.runtime.router.registry import WorkerRegistry
from kvflow.runtime.router.worker import Worker

__all__ = [
    "METRIC_NAMES",
    "POLICIES",
    "AdapterSync",
    "AdmissionConfig",
    "BreakerConfig",
    "CacheAwareConfig",
    "Forwarder",
    "HealthConfig",
    "Policy",
    "RetryConfig",
    "RouterConfig",
    "RouterMetrics",
    "Selection",
    "Worker",
    "WorkerRegistry",
]
