"""Keeping each managed worker's LoRA adapters as wanted: learn, load, unload.

A worker is managed when its :class:`WorkerSpec` carries ``lora_adapters`` (a discovered
pod's annotation, written by the operator; or ``--lora-adapters`` for static workers).
:meth:`AdapterSync.check` runs after each passed health check: ``GET /v1/models`` (the
adapters are the cards with a ``parent``, SGLang's shape), then ``POST
/load_lora_adapter`` for each wanted adapter that is missing (or loaded from another path)
and ``POST /unload_lora_adapter`` for each loaded one that is not wanted. The worker
refuses an unload while requests on the adapter are in flight; the next check tries again.
Calls carry the router's API key, the workers' own (``$KVFLOW_API_KEY``).

:meth:`AdapterSync.ensure` loads wanted adapters on one worker at once, for a request
that no worker can serve yet (a pod that just became Ready, say). One worker's calls never
overlap (a lock per worker).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from kvflow.runtime.router.metrics import RouterMetrics
from kvflow.runtime.router.registry import WorkerRegistry
from kvflow.runtime.router.worker import Worker
from kvflow.runtime.wire import RequestError

__all__ = ["AdapterSync"]

log = logging.getLogger("kvflow.router")

_ERRORS = (aiohttp.ClientError, TimeoutError, OSError, ValueError)


class AdapterSync:
    """Loads and unloads adapters on managed workers; see the module docstring."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        metrics: RouterMetrics,
        api_key: str | None,
        timeout_s: float = 120.0,
    ) -> None:
        self.session = session
        self.metrics = metrics
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, worker: Worker) -> asyncio.Lock:
        return self._locks.setdefault(worker.url, asyncio.Lock())

    def unknown(self, worker: Worker) -> None:
        """The worker failed a check (it may be restarting, adapters lost): until it is
        asked again, no request counts on its adapters."""
        if worker.adapters is not None:
            self._set(worker, {})
            worker.adapters = None

    def forget(self, url: str) -> None:
        """The worker left: drop its lock (its metric children go with the worker's)."""
        self._locks.pop(url, None)

    async def check(self, worker: Worker) -> None:
        """Learn what ``worker`` has loaded and make it what its spec wants."""
        wanted = worker.desired_adapters
        if wanted is None:
            return
        async with self._lock(worker):
            if not await self._refresh(worker):
                return
            await self._converge(worker, wanted)

    async def ensure(self, worker: Worker, names: frozenset[str]) -> bool:
        """Load the wanted adapters of ``names`` that ``worker`` lacks; whether it has all
        of ``names`` afterwards."""
        wanted = worker.desired_adapters or {}
        async with self._lock(worker):
            if worker.adapters is None and not await self._refresh(worker):
                return False
            for name in sorted(names - (worker.adapters or {}).keys()):
                if name in wanted:
                    await self._load(worker, name, wanted[name])
        return worker.has_adapters(names)

    async def ready(self, registry: WorkerRegistry, adapters: frozenset[str]) -> None:
        """Make sure some available worker of each role a request naming ``adapters``
        needs has them: when none has them yet but some should (a pod that just became
        Ready), load them on the least loaded of those now. An adapter no worker has or
        should have is the client's error (400, in the workers' wording)."""
        for name in sorted(adapters):
            self.metrics.lora_requests.labels(name).inc()
        roles = ("prefill", "decode") if registry.has_pd() else (registry.main_role(),)
        for role in roles:
            available = registry.available(role)
            if not available or any(w.has_adapters(adapters) for w in available):
                continue  # none available: planning answers 503 with the cause
            wanting = [w for w in available if adapters <= (w.desired_adapters or {}).keys()]
            if not wanting:
                loaded = sorted({n for w in available for n in w.adapters or ()})
                unknown = sorted(n for n in adapters if n not in registry.adapter_names())
                names = ", ".join(repr(n) for n in unknown or sorted(adapters))
                raise RequestError(
                    400, f"unknown LoRA adapter {names} (loaded: {', '.join(loaded) or 'none'})"
                )
            worker = min(wanting, key=lambda w: w.load)
            if not await self.ensure(worker, adapters):
                raise RequestError(
                    503,
                    f"LoRA adapter(s) {', '.join(sorted(adapters))} could not be loaded on "
                    f"{worker.url}; see the router's log",
                )

    async def _converge(self, worker: Worker, wanted: dict[str, str]) -> None:
        loaded = dict(worker.adapters or {})
        for name in sorted(loaded.keys() - wanted.keys()):
            await self._unload(worker, name)
        for name, path in sorted(wanted.items()):
            moved = name in loaded and loaded[name] != path
            if moved and not await self._unload(worker, name):
                continue  # still in use from its old path: the next check tries again
            if name not in (worker.adapters or {}):
                await self._load(worker, name, path)

    async def _refresh(self, worker: Worker) -> bool:
        """``worker.adapters`` from its ``/v1/models``; False when it did not answer."""
        try:
            async with self.session.get(
                worker.url + "/v1/models", headers=self.headers, timeout=self.timeout
            ) as response:
                body = await response.json(content_type=None)
                if response.status != 200:
                    raise ValueError(f"/v1/models answered {response.status}: {body}")
        except _ERRORS as err:
            log.warning("worker %s: cannot list its LoRA adapters: %s", worker.url, err)
            return False
        cards = body.get("data") or [] if isinstance(body, dict) else []
        adapters = {
            str(c["id"]): str(c.get("root", ""))
            for c in cards
            if isinstance(c, dict) and c.get("parent") and "id" in c
        }
        self._set(worker, adapters)
        return True

    def _set(self, worker: Worker, adapters: dict[str, str]) -> None:
        before = set(worker.adapters or {})
        worker.adapters = adapters
        for name in before - adapters.keys():
            self.metrics.lora_loaded.remove(worker.url, name)
        for name in adapters.keys() - before:
            self.metrics.lora_loaded.labels(worker.url, name).set(1)

    async def _post(self, worker: Worker, route: str, body: dict[str, Any]) -> str:
        """POST one LoRA admin call; empty on success, else why it failed."""
        try:
            async with self.session.post(
                worker.url + route, json=body, headers=self.headers, timeout=self.timeout
            ) as response:
                text = await response.text()
                return "" if response.status == 200 else f"{response.status}: {text[:300]}"
        except _ERRORS as err:
            return f"{type(err).__name__} {err}".strip()

    async def _load(self, worker: Worker, name: str, path: str) -> bool:
        error = await self._post(
            worker, "/load_lora_adapter", {"lora_name": name, "lora_path": path}
        )
        return self._outcome(worker, "load", name, error, {**(worker.adapters or {}), name: path})

    async def _unload(self, worker: Worker, name: str) -> bool:
        error = await self._post(worker, "/unload_lora_adapter", {"lora_name": name})
        rest = {k: v for k, v in (worker.adapters or {}).items() if k != name}
        return self._outcome(worker, "unload", name, error, rest)

    def _outcome(
        self, worker: Worker, operation: str, name: str, error: str, after: dict[str, str]
    ) -> bool:
        result = "error" if error else "ok"
        self.metrics.lora_operations.labels(name, operation, result).inc()
        if error:
            log.warning("worker %s: %s of LoRA adapter %r failed: %s", worker.url, operation,
                        name, error)  # fmt: skip
            return False
        log.info("worker %s: LoRA adapter %r %sed", worker.url, name, operation)
        self._set(worker, after)
        return True
