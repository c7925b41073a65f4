"""Active health checks and load scrapes, one timer for every worker."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvflow import contract
from kvflow.runtime.router.adapter_sync import AdapterSync
from kvflow.runtime.router.config import HealthConfig
from kvflow.runtime.router.registry import WorkerRegistry
from kvflow.runtime.router.worker import Worker

__all__ = ["LOAD_METRICS", "HealthChecker", "health_error", "parse_load", "probe_pair"]

log = logging.getLogger("kvflow.router")

# The worker's own queue figures (SGLang's names, which kvflow workers export).
LOAD_METRICS = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
# A worker gives its own probe 60 s to produce a token before it answers 503.
PROBE_TIMEOUT_S = 60.0


def parse_load(text: str) -> int | None:
    """Running + queued requests from a worker's Prometheus text; ``None`` if absent."""
    total, seen = 0.0, False
    for family in text_string_to_metric_families(text):
        if family.name in LOAD_METRICS:
            for sample in family.samples:
                total += sample.value
                seen = True
    return int(total) if seen else None


async def health_error(
    session: aiohttp.ClientSession, worker: Worker, timeout: aiohttp.ClientTimeout
) -> str:
    """Why one ``GET /health`` of ``worker`` failed; empty when it answered 200."""
    try:
        async with session.get(worker.url + contract.HEALTH_PATH, timeout=timeout) as response:
            await response.read()
            return "" if response.status == 200 else f"/health answered {response.status}"
    except (aiohttp.ClientError, TimeoutError, OSError) as err:
        return f"/health failed: {type(err).__name__} {err}".strip()


class HealthChecker:
    """Every ``interval_s``: ``GET /health`` on each worker; on success ``GET /metrics``.

    ``failure_threshold`` failed checks in a row mark a worker unhealthy,
    ``success_threshold`` passed ones healthy again. A passed check also counts as the
    half-open probe of an open breaker whose cooldown is over, so a restarted worker
    rejoins without a client request having to risk it.

    With ``adapters``, a passed check also keeps a managed worker's LoRA adapters as
    wanted (:class:`AdapterSync`), and a worker added or changed (a new adapter list in
    its pod's annotation) is checked at once rather than at the next tick.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        config: HealthConfig,
        session: aiohttp.ClientSession,
        adapters: AdapterSync | None = None,
    ) -> None:
        self.registry = registry
        self.config = config
        self.session = session
        self.adapters = adapters
        self._task: asyncio.Task[None] | None = None
        self._kicked: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="router-health")
        if self.adapters is not None:
            self.registry.on_change(self._kick)

    def _kick(self, worker: Worker) -> None:
        if self._task is None or worker.desired_adapters is None:
            return
        task = asyncio.create_task(self.check(worker), name=f"router-check {worker.url}")
        self._kicked.add(task)
        task.add_done_callback(self._kicked.discard)

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._kicked) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.config.interval_s)

    async def check_all(self) -> None:
        workers = list(self.registry.all())
        if workers:
            await asyncio.gather(*(self.check(w) for w in workers))

    async def check(self, worker: Worker) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        error = await health_error(self.session, worker, timeout)
        if error:
            self._failed(worker, error)
            if self.adapters is not None:
                self.adapters.unknown(worker)
            return
        self._passed(worker)
        await self._scrape_load(worker, timeout)
        if self.adapters is not None and worker.healthy:
            await self.adapters.check(worker)

    def _failed(self, worker: Worker, error: str) -> None:
        worker.passed_checks = 0
        worker.failed_checks += 1
        worker.last_error = error
        if worker.healthy and worker.failed_checks >= self.config.failure_threshold:
            worker.healthy = False
            self.registry.metrics.healthy.labels(worker.url).set(0)
            log.warning("worker %s unhealthy: %s", worker.url, error)

    def _passed(self, worker: Worker) -> None:
        worker.failed_checks = 0
        worker.passed_checks += 1
        if not worker.healthy and worker.passed_checks >= self.config.success_threshold:
            worker.healthy = True
            worker.last_error = ""
            self.registry.metrics.healthy.labels(worker.url).set(1)
            log.info("worker %s healthy again", worker.url)
        if worker.healthy and worker.breaker.state.value != "closed" and worker.breaker.allows():
            worker.breaker.record_success()

    async def _scrape_load(self, worker: Worker, timeout: aiohttp.ClientTimeout) -> None:
        try:
            async with self.session.get(worker.url + contract.METRICS_PATH, timeout=timeout) as r:
                if r.status != 200:
                    return
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return  # load is a refinement: a failed scrape keeps the last figure
        try:
            load = parse_load(text)
        except ValueError:
            return
        if load is not None:
            worker.report_load(load)
            self.registry.metrics.load.labels(worker.url).set(worker.load)


async def _probe_role(
    session: aiohttp.ClientSession, registry: WorkerRegistry, role: str, headers: dict[str, str]
) -> str | None:
    """None once one available worker of ``role`` answers ``/health_generate`` with 200
    (least loaded first); else why none did."""
    workers = sorted(registry.available(role), key=lambda w: w.load)
    if not workers:
        return registry.why_none(role)
    errors = []
    for worker in workers:
        try:
            url = worker.url + contract.HEALTH_GENERATE_PATH
            async with session.get(url, headers=headers) as response:
                await response.read()
                if response.status == 200:
                    return None
                errors.append(f"{worker.url} answered {response.status}")
        except (aiohttp.ClientError, OSError) as err:
            errors.append(f"{worker.url}: {type(err).__name__} {err}".strip())
    return f"no {role} worker passed {contract.HEALTH_GENERATE_PATH}: " + "; ".join(errors)


async def probe_pair(
    session: aiohttp.ClientSession, registry: WorkerRegistry, headers: dict[str, str]
) -> str | None:
    """PD mode's ``/health_generate``: None when a prefill and a decode each answer their
    own ``/health_generate`` with 200 (probed at once, within :data:`PROBE_TIMEOUT_S`);
    else what failed."""
    roles = ("prefill", "decode")
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            problems = await asyncio.gather(
                *(_probe_role(session, registry, role, headers) for role in roles)
            )
    except TimeoutError:
        return f"no prefill/decode pair passed its probe within {PROBE_TIMEOUT_S:g} s"
    return "; ".join(p for p in problems if p) or None
