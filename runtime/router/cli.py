"""``kvflow router``: parse flags, start discovery and health checks, serve until a signal."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
import signal
import sys
from typing import Any

import aiohttp
import prometheus_client
from aiohttp import web

from kvflow.runtime.router import logs
from kvflow.runtime.router.adapter_sync import AdapterSync
from kvflow.runtime.router.app import create_admin_app, create_app
from kvflow.runtime.router.args import parse_args, static_specs
from kvflow.runtime.router.config import RouterConfig
from kvflow.runtime.router.health import HealthChecker
from kvflow.runtime.router.metrics import RouterMetrics
from kvflow.runtime.router.policies import POLICIES
from kvflow.runtime.router.proxy import Forwarder
from kvflow.runtime.router.registry import WorkerRegistry

__all__ = ["StartupError", "main", "serve"]

log = logging.getLogger("kvflow.router")

_KUBE_DISCOVERY = "kvflow.runtime.router.discovery.kube"


def _new_session(config: RouterConfig) -> aiohttp.ClientSession:
    """The pooled client every request, health check and load scrape goes through.

    A proxy's client keeps no cookies (one client's would go out with everybody's
    requests) and adds no ``Accept-Encoding`` or ``User-Agent`` of its own: the client's
    ``Accept-Encoding`` is forwarded, and bodies pass through undecoded.
    """
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
    )


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    """Run the router until ``stop`` is set (or SIGTERM/SIGINT when not given)."""
    # No `_created` series (a start timestamp per counter/histogram child): Prometheus
    # does not need them. The switch is process-wide; this process is the router.
    prometheus_client.disable_created_metrics()
    metrics = RouterMetrics()
    registry = WorkerRegistry(config.breaker, metrics)
    for spec in static_specs(config):
        registry.upsert(spec)
    session = _new_session(config)
    adapters = AdapterSync(session, metrics, config.api_key)
    policy = POLICIES.get(config.policy)(config)
    forwarder = Forwarder(config, registry, policy, metrics, session, adapters)
    health = HealthChecker(registry, config.health, session, adapters)
    discovery: Any = None
    if config.discovers:
        kube = importlib.import_module(_KUBE_DISCOVERY)
        discovery = kube.KubeDiscovery(
            namespace=config.discover_namespace,  # None: the pod's own namespace
            selector=config.discover_selector or "",
            sink=registry,
        )
    # handler_cancellation: a client that disconnects cancels its handler, which closes
    # the upstream connection, so the worker aborts the request.
    runner = web.AppRunner(
        create_app(forwarder, config.api_key), handler_cancellation=True, access_log=None
    )
    await runner.setup()
    admin: web.AppRunner | None = None
    if config.admin_port is not None:
        admin = web.AppRunner(create_admin_app(forwarder, config.api_key), access_log=None)
        await admin.setup()
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    flusher: asyncio.Task[None] | None = None
    try:
        if discovery is not None:
            try:
                await discovery.start()
            except Exception as err:  # a missing or wrong client configuration, say
                raise StartupError(
                    f"worker discovery did not start: {type(err).__name__}: {err}"
                ) from err
        health.start()
        await web.TCPSite(runner, config.host, config.port, backlog=4096).start()
        if admin is not None:
            await web.TCPSite(admin, config.admin_host, config.admin_port).start()
        flusher = asyncio.create_task(logs.flush_every())
        _settle_gc()
        log.info(
            "kvflow router on http://%s:%d, policy %s, %d static workers%s",
            config.host,
            config.port,
            config.policy,
            len(registry.all()),
            f", discovering in {discovery.namespace}" if discovery is not None else "",
        )
        await stop.wait()
    finally:
        if flusher is not None:
            flusher.cancel()
        await health.stop()
        if discovery is not None:
            with contextlib.suppress(Exception):
                await discovery.stop()
        await runner.cleanup()
        if admin is not None:
            await admin.cleanup()
        await session.close()


def _settle_gc() -> None:
    """Freeze the startup heap (aiohttp, prometheus_client, the Kubernetes client: some
    100,000 objects) out of later collections, so a full collection, which stalls every
    stream, scans only what requests left behind. Process-wide. (The youngest generation
    keeps Python's threshold: collecting it less often saved CPU but made each pause, and
    the 99th percentile, longer.)"""
    gc.collect()
    gc.freeze()


class StartupError(RuntimeError):
    """The router cannot start (reported as one line, exit status 1)."""


def _run(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)


def main(argv: list[str] | None = None) -> int:
    config = parse_args(sys.argv[1:] if argv is None else list(argv))
    logs.configure(config.log_level)
    try:
        _run(serve(config))
    except StartupError as err:
        log.error("%s", err)
        return 1
    return 0
