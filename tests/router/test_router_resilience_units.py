"""Breaker, backoff, admission queue and load parsing, without processes."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.runtime.router import AdmissionConfig, BreakerConfig, RetryConfig, RouterMetrics
from kvflow.runtime.router.admission import Admission
from kvflow.runtime.router.backoff import RetryBudget, backoff_delay
from kvflow.runtime.router.breaker import BreakerState, CircuitBreaker
from kvflow.runtime.router.health import parse_load
from kvflow.runtime.wire import RequestError

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_half_opens_and_closes():
    clock, moves = Clock(), []
    breaker = CircuitBreaker(
        BreakerConfig(failure_threshold=3, cooldown_s=5),
        clock=clock,
        on_transition=lambda old, new: moves.append((old.value, new.value)),
    )
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.allows() and breaker.state is BreakerState.CLOSED
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allows() and not breaker.peek()
    clock.now += 5
    assert breaker.peek()
    assert breaker.allows() and breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allows(), "one probe at a time"
    breaker.record_failure()  # the probe failed: open again, a new cooldown
    assert breaker.state is BreakerState.OPEN and not breaker.allows()
    clock.now += 5
    assert breaker.allows()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.consecutive_failures == 0
    assert moves == [
        ("closed", "open"),
        ("open", "half_open"),
        ("half_open", "open"),
        ("open", "half_open"),
        ("half_open", "closed"),
    ]


def test_a_lost_probe_frees_its_slot_after_a_cooldown():
    clock = Clock()
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=1, cooldown_s=2), clock=clock)
    breaker.record_failure()
    clock.now += 2
    assert breaker.allows() and not breaker.allows()
    clock.now += 2  # the probe never reported back
    assert breaker.allows()


def test_success_in_between_resets_the_failure_count():
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=2, cooldown_s=1))
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED


def test_backoff_doubles_with_jitter_and_a_cap():
    config = RetryConfig(initial_backoff_s=0.1, max_backoff_s=0.5, jitter=0.5)
    assert [backoff_delay(i, config, rand=lambda: 0.0) for i in range(4)] == [0.1, 0.2, 0.4, 0.5]
    assert backoff_delay(1, config, rand=lambda: 1.0) == pytest.approx(0.1)
    assert all(0.05 <= backoff_delay(0, config) <= 0.1 for _ in range(100))


def test_retry_budget_bounds_count_and_time():
    clock = Clock()
    budget = RetryBudget(
        RetryConfig(max_retries=3, initial_backoff_s=1, max_backoff_s=8, jitter=0, budget_s=100),
        clock=clock,
    )
    assert [budget.next_delay() for _ in range(4)] == [1, 2, 4, None]
    clock = Clock()
    budget = RetryBudget(
        RetryConfig(max_retries=10, initial_backoff_s=1, max_backoff_s=8, jitter=0, budget_s=2.5),
        clock=clock,
    )
    assert budget.next_delay() == 1
    clock.now += 1
    assert budget.next_delay() is None  # 1 s left, the next backoff is 2 s


def test_admission_queues_then_refuses_with_retry_after():
    async def scenario() -> None:
        admission = Admission(
            AdmissionConfig(max_concurrent=1, max_queued=1, queue_timeout_s=0.2, retry_after_s=3),
            RouterMetrics(),
        )
        order: list[str] = []
        release = asyncio.Event()

        async def holder() -> None:
            async with admission.slot():
                order.append("first")
                await release.wait()

        async def waiter() -> None:
            async with admission.slot():
                order.append("second")

        first = asyncio.create_task(holder())
        await asyncio.sleep(0.01)
        second = asyncio.create_task(waiter())
        await asyncio.sleep(0.01)
        assert admission.queued == 1
        with pytest.raises(RequestError) as full:
            async with admission.slot():
                pass
        assert full.value.status == 429 and full.value.headers == {"Retry-After": "3"}
        release.set()
        await asyncio.gather(first, second)
        assert order == ["first", "second"] and admission.active == 0
        # a waiter that times out gets a 429 too, and leaves no trace
        release.clear()
        first = asyncio.create_task(holder())
        await asyncio.sleep(0.01)
        with pytest.raises(RequestError) as late:
            async with admission.slot():
                pass
        assert late.value.status == 429 and admission.queued == 0
        release.set()
        await first
        assert admission.active == 0

    asyncio.run(scenario())


def test_parse_load_reads_sglang_queue_metrics():
    text = (
        '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m"} 3.0\n'
        '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="m"} 2.0\n'
        'sglang:token_usage{model_name="m"} 0.5\n'
    )
    assert parse_load(text) == 5
    assert parse_load("other_metric 1\n") is None


def test_the_503_names_the_cause_without_guessing_a_role():
    from kvflow.runtime.router.discovery.base import WorkerSpec
    from kvflow.runtime.router.registry import WorkerRegistry

    registry = WorkerRegistry(BreakerConfig(), RouterMetrics())
    empty = registry.why_none(registry.main_role())
    assert empty.startswith("no worker is registered yet") and "unified" not in empty
    registry.upsert(WorkerSpec("http://127.0.0.1:1", "decode"))
    assert registry.why_none("prefill") == "no prefill worker is registered"
    registry.get("http://127.0.0.1:1").healthy = False  # type: ignore[union-attr]
    assert registry.why_none("decode").startswith("no healthy decode worker: 1 known, 1 failing")
