"""The autoscaling rule: one role's signals and history in, desired replicas and a reason out.

:func:`decide` is pure: the same policy, signals, state and time give the same decision,
and the caller keeps the returned :class:`ScaleState` for the next call.

The rule (Dynamo's planner splits it the same way: prefill is judged by queueing and TTFT,
decode by KV occupancy, batch fill and ITL)::

    prefill   waiting requests per replica vs targets.queuePerReplica, TTFT p90 vs ttftMs
    decode    KV usage vs kvUsage, running requests per replica vs 90% of
              maxRunningRequests, ITL p90 vs itlMs
    unified   all of the above

1. Hold when a Ready pod reports no fresh metrics (scrape failed, stale, NaN), or none
   reports at all; the size is only clamped into ``[minReplicas, maxReplicas]``.
2. Each configured signal with evidence gives ``ratio = value / target`` and, outside the
   tolerance band ``|ratio - 1| <= tolerance``, a recommendation ``ceil(reporting * ratio)``
   (latency ratios capped at 2: latency is not proportional to load). Inside the band it
   recommends the current size. A latency with no finished token in the window is no
   evidence, except on an idle role (nothing queued or running), where it counts as zero.
   The role's recommendation is the largest (any signal may hold capacity), at most double
   the current size, clamped into ``[max(minReplicas, 1), maxReplicas]``.
3. Scale out to the *smallest* recommendation of the last ``scale_up_window_s`` (pressure
   must be sustained that long; 0 reacts at once), unless a scale-out happened less than
   ``scale_up_cooldown_s`` ago or pods of the last one are not Ready yet.
4. Scale in to the *largest* recommendation of the last ``scaleDownStabilizationSeconds``
   (every recommendation in the window must allow it), one replica at a time, no sooner
   than ``scale_down_cooldown_s`` after any change.

A window counts only when the history reaches back to its start, so an operator restart
or a metrics gap delays a change rather than hastening it. Steps 3 and 4 together are the
hysteresis: a load oscillating faster than either window moves nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .signals import RoleSignals

__all__ = ["ROLE_SIGNALS", "Decision", "ScalePolicy", "ScaleState", "decide"]

# Which signals judge which role.
ROLE_SIGNALS = {
    "prefill": ("queue", "ttft"),
    "decode": ("kv", "running", "itl"),
    "unified": ("queue", "ttft", "kv", "running", "itl"),
}
RUNNING_FILL = 0.9  # running requests target: this fraction of maxRunningRequests
LATENCY_RATIO_CAP = 2.0


@dataclass(frozen=True)
class ScalePolicy:
    """One role's bounds, targets and timings (targets None are not used)."""

    role: str
    min_replicas: int = 1
    max_replicas: int = 4
    queue_per_replica: float | None = None
    kv_usage: float | None = None
    running_per_replica: float | None = None
    ttft_s: float | None = None
    itl_s: float | None = None
    scale_down_window_s: float = 300.0
    scale_up_window_s: float = 10.0
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 60.0
    tolerance: float = 0.1

    @property
    def floor(self) -> int:
        """Smallest size the autoscaler sets: with no pod there is no signal to scale out
        from, so ``minReplicas: 0`` still keeps one."""
        return max(self.min_replicas, 1)

    def clamp(self, replicas: int) -> int:
        return min(max(replicas, self.floor), self.max_replicas)


@dataclass(frozen=True)
class ScaleState:
    """What :func:`decide` remembers between calls."""

    history: tuple[tuple[float, int], ...] = ()  # (time, recommendation), oldest first
    last_scale_up: float | None = None
    last_change: float | None = None


@dataclass(frozen=True)
class Decision:
    """The size to run and why; ``direction`` is ``up``, ``down`` or ``hold``."""

    replicas: int
    direction: str
    reason: str

    @property
    def changed(self) -> bool:
        return self.direction != "hold"


@dataclass(frozen=True)
class _Vote:
    signal: str
    value: float
    target: float
    replicas: int


def _votes(policy: ScalePolicy, signals: RoleSignals) -> list[_Vote]:
    n = signals.reporting
    idle = signals.idle
    measured = {
        "queue": (signals.queue_per_replica, policy.queue_per_replica, False),
        "running": (signals.running_per_replica, policy.running_per_replica, False),
        "kv": (signals.kv_usage, policy.kv_usage, False),
        "ttft": (signals.ttft_p90_s, policy.ttft_s, True),
        "itl": (signals.itl_p90_s, policy.itl_s, True),
    }
    votes = []
    for name in ROLE_SIGNALS.get(policy.role, ROLE_SIGNALS["unified"]):
        value, target, latency = measured[name]
        if target is None or target <= 0:
            continue
        if value is None:
            if not idle:
                continue  # no evidence either way
            value = 0.0
        ratio = value / target
        if latency:
            ratio = min(ratio, LATENCY_RATIO_CAP)
        replicas = n if abs(ratio - 1) <= policy.tolerance else math.ceil(n * ratio)
        votes.append(_Vote(name, value, target, replicas))
    return votes


def _window_values(
    history: Sequence[tuple[float, int]], now: float, window: float
) -> list[int] | None:
    """Recommendations in force during ``[now - window, now]``, or None when the history
    does not reach back that far."""
    start = now - window
    before = [rec for t, rec in history if t <= start]
    if not before:
        return None
    return [before[-1], *(rec for t, rec in history if t > start)]


def _describe(vote: _Vote) -> str:
    return f"{vote.signal} {vote.value:.3g} vs target {vote.target:.3g}"


def decide(
    policy: ScalePolicy, signals: RoleSignals, current: int, state: ScaleState, now: float
) -> tuple[Decision, ScaleState]:
    """Desired replicas of one role (module docstring has the rule)."""
    bounded = policy.clamp(current)
    if bounded != current:
        direction = "up" if bounded > current else "down"
        reason = f"clamped into [{policy.floor}, {policy.max_replicas}]: {current} -> {bounded}"
        return Decision(bounded, direction, reason), replace(state, history=(), last_change=now)
    if signals.missing or signals.reporting == 0:
        who = ", ".join(signals.missing) or "no Ready pod"
        # windows restart after a gap: what was recommended before it is no evidence now
        hold = Decision(current, "hold", f"metrics missing ({who}): holding {current}")
        return hold, replace(state, history=())

    votes = _votes(policy, signals)
    if not votes:
        return Decision(current, "hold", f"no signal with evidence: holding {current}"), state
    driver = max(votes, key=lambda v: v.replicas)
    recommended = policy.clamp(min(driver.replicas, 2 * max(current, 1)))
    keep_for = max(policy.scale_up_window_s, policy.scale_down_window_s)
    history = tuple((t, r) for t, r in state.history if t >= now - keep_for)
    # keep the newest entry at or before the window start: it is the value in force then
    older = [(t, r) for t, r in state.history if t < now - keep_for]
    history = (*older[-1:], *history, (now, recommended))
    state = replace(state, history=history)

    up_window = _window_values(history, now, policy.scale_up_window_s)
    if up_window is not None and min(up_window) > current:
        target = min(up_window)
        if (
            state.last_scale_up is not None
            and now - state.last_scale_up < policy.scale_up_cooldown_s
        ):
            wait = policy.scale_up_cooldown_s - (now - state.last_scale_up)
            return Decision(
                current, "hold", f"{_describe(driver)}: scale-up cooldown, {wait:.0f}s left"
            ), state
        if signals.ready < current:
            reason = (
                f"{_describe(driver)}: waiting for {current - signals.ready} pod(s) to become Ready"
            )
            return Decision(current, "hold", reason), state
        reason = f"{_describe(driver)} for {policy.scale_up_window_s:.0f}s: {current} -> {target}"
        return Decision(target, "up", reason), replace(state, last_scale_up=now, last_change=now)

    down_window = _window_values(history, now, policy.scale_down_window_s)
    if down_window is not None and max(down_window) < current:
        if state.last_change is not None and now - state.last_change < policy.scale_down_cooldown_s:
            wait = policy.scale_down_cooldown_s - (now - state.last_change)
            return Decision(
                current, "hold", f"{_describe(driver)}: scale-down cooldown, {wait:.0f}s left"
            ), state
        target = max(max(down_window), current - 1)
        reason = (
            f"{_describe(driver)}, at most {max(down_window)} needed for "
            f"{policy.scale_down_window_s:.0f}s: {current} -> {target}"
        )
        return Decision(target, "down", reason), replace(state, last_change=now)

    return Decision(current, "hold", f"{_describe(driver)}: {current} fits"), state
