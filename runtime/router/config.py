"""The router's configuration: a chain of frozen dataclasses, parsed once from the CLI.

Defaults live here and nowhere else; ``kvflow router`` flags take them from these classes.
Cache-aware thresholds follow sglang-router 0.3's defaults (``router_args.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow import contract

__all__ = [
    "AdmissionConfig",
    "BreakerConfig",
    "CacheAwareConfig",
    "HealthConfig",
    "RetryConfig",
    "RouterConfig",
]


@dataclass(frozen=True)
class HealthConfig:
    """Active checks: ``GET /health`` (and a ``/metrics`` load scrape) every ``interval_s``."""

    interval_s: float = 5.0
    timeout_s: float = 2.0
    failure_threshold: int = 2  # consecutive failed checks before a worker is unhealthy
    success_threshold: int = 1  # consecutive passed checks before it is healthy again


@dataclass(frozen=True)
class BreakerConfig:
    """Per-worker circuit breaker over request outcomes (connect errors and 5xx fail)."""

    failure_threshold: int = 3  # consecutive failures that open the breaker
    cooldown_s: float = 5.0  # open -> half-open after this long; one probe at a time


@dataclass(frozen=True)
class RetryConfig:
    """Retries on another worker, only before the client saw a byte."""

    max_retries: int = 2
    initial_backoff_s: float = 0.02
    max_backoff_s: float = 0.5
    jitter: float = 0.5  # fraction of each delay drawn at random
    budget_s: float = 10.0  # total time the retries of one request may take


@dataclass(frozen=True)
class AdmissionConfig:
    """Concurrency limit with a bounded FIFO queue in front of it."""

    max_concurrent: int = 1024
    max_queued: int = 2048
    queue_timeout_s: float = 30.0
    request_timeout_s: float = 1800.0
    retry_after_s: int = 1  # the Retry-After a 429 carries


@dataclass(frozen=True)
class CacheAwareConfig:
    """Thresholds of the ``cache_aware`` policy (sglang-router's names and defaults)."""

    cache_threshold: float = 0.3  # route by cache when matched / prompt length passes this
    balance_abs_threshold: int = 64  # imbalanced when max load - min load > this ...
    balance_rel_threshold: float = 1.5  # ... and max load > min load * this
    max_tree_size: int = 2**26  # characters (or token ids) kept per worker before LRU eviction


@dataclass(frozen=True)
class RouterConfig:
    """Everything one ``kvflow router`` process starts with."""

    host: str = "0.0.0.0"
    port: int = contract.DEFAULT_API_PORT
    policy: str = "cache_aware"
    worker_urls: tuple[str, ...] = ()
    prefill_urls: tuple[str, ...] = ()  # each "URL" or "URL#BOOTSTRAP_PORT"
    decode_urls: tuple[str, ...] = ()
    discover_namespace: str | None = None
    discover_selector: str | None = None
    lora_adapters: tuple[tuple[str, str], ...] | None = None  # static workers': --lora-adapters
    bootstrap_port: int = contract.DEFAULT_BOOTSTRAP_PORT  # prefill default when not given
    api_key: str | None = None
    internal_key: str | None = None  # signs PD pairs (bootstrap_token); $KVFLOW_INTERNAL_KEY
    admin_host: str = "127.0.0.1"  # with admin_port: where the admin routes listen
    admin_port: int | None = (
        None  # the admin routes (/workers) on their own port; None: the API port
    )
    connect_timeout_s: float = 5.0
    log_level: str = "info"
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)

    @property
    def discovers(self) -> bool:
        """Workers come from the Kubernetes API rather than flags."""
        return bool(self.discover_namespace or self.discover_selector)
