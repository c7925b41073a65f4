"""The autoscaling rule (kvflow.operator.autoscale.decision) and the signals it reads."""

from __future__ import annotations

import itertools
import math

import pytest

from kvflow.operator.autoscale import (
    Buckets,
    PodSample,
    RoleSignals,
    ScalePolicy,
    ScaleState,
    decide,
    histogram_quantile,
    role_signals,
)

INF = math.inf
TICK = 5.0


def signals(
    reporting: int = 2,
    *,
    ready: int | None = None,
    queue: float = 0.0,
    running: float = 0.0,
    kv: float = 0.0,
    ttft: float | None = None,
    itl: float | None = None,
    missing: tuple[str, ...] = (),
) -> RoleSignals:
    return RoleSignals(
        ready=reporting + len(missing) if ready is None else ready,
        reporting=reporting,
        missing=missing,
        queue_per_replica=queue,
        running_per_replica=running,
        kv_usage=kv,
        ttft_p90_s=ttft,
        itl_p90_s=itl,
        cached_kv={},
    )


DECODE = ScalePolicy(
    "decode",
    min_replicas=1,
    max_replicas=6,
    kv_usage=0.7,
    itl_s=0.1,
    running_per_replica=9.0,
    scale_down_window_s=60,
    scale_up_window_s=10,
    scale_up_cooldown_s=20,
    scale_down_cooldown_s=30,
)
PREFILL = ScalePolicy("prefill", queue_per_replica=4, ttft_s=1.0, scale_down_window_s=60)


class Run:
    """Feeds one signal per tick through decide(), keeping state and size like the loop."""

    def __init__(self, policy: ScalePolicy, replicas: int, start: float = 1000.0) -> None:
        self.policy, self.replicas, self.now = policy, replicas, start
        self.state = ScaleState()
        self.changes: list[tuple[float, int, str]] = []
        self.last = None

    def tick(self, sig: RoleSignals) -> None:
        decision, self.state = decide(self.policy, sig, self.replicas, self.state, self.now)
        self.last = decision
        if decision.changed:
            self.replicas = decision.replicas
            self.changes.append((self.now, decision.replicas, decision.reason))
        self.now += TICK

    def run(self, seconds: float, make) -> None:
        end = self.now + seconds
        while self.now < end:
            self.tick(make(self.replicas))


def test_scale_out_needs_sustained_pressure_then_reacts_within_window():
    r = Run(DECODE, 2)
    r.tick(signals(2, kv=0.95))  # one hot tick: no history back to the window start
    assert r.replicas == 2
    r.tick(signals(2, kv=0.3))  # pressure gone: the window's minimum is low
    r.run(8, lambda n: signals(n, kv=0.95))
    assert r.replicas == 2, r.changes
    r.run(10, lambda n: signals(n, kv=0.95))
    assert r.replicas == 3  # ceil(2 * 0.95 / 0.7)
    assert "kv 0.95 vs target 0.7" in r.changes[0][2]


def test_cooldown_and_pending_pods_gate_the_next_scale_out():
    r = Run(DECODE, 2)
    r.run(15, lambda n: signals(n, kv=0.95))
    assert r.replicas == 3
    # the new pod is not Ready yet: hotter still, but no further scale-out
    r.run(30, lambda n: signals(2, ready=2, kv=0.95, running=20))
    assert r.replicas == 3
    assert "to become Ready" in r.last.reason
    # Ready now, still hot: next step only after the cooldown (already passed here)
    r.tick(signals(3, kv=0.95))
    assert r.replicas == 5  # ceil(3 * 0.95 / 0.7)
    first, second = r.changes[0][0], r.changes[1][0]
    assert second - first >= DECODE.scale_up_cooldown_s


def test_scale_up_cooldown_holds_with_reason():
    policy = ScalePolicy("decode", kv_usage=0.5, scale_up_window_s=0, scale_up_cooldown_s=60)
    r = Run(policy, 1)
    r.tick(signals(1, kv=0.9))
    assert r.replicas == 2
    r.tick(signals(2, kv=0.9))
    assert r.replicas == 2 and "cooldown" in r.last.reason


def test_scale_in_waits_for_stabilization_window_and_steps_one_at_a_time():
    r = Run(DECODE, 4)
    start = r.now
    r.run(200, lambda n: signals(n, kv=0.05))
    times = [t - start for t, _, _ in r.changes]
    sizes = [n for _, n, _ in r.changes]
    assert sizes == [3, 2, 1]
    assert times[0] >= DECODE.scale_down_window_s
    assert all(b - a >= DECODE.scale_down_cooldown_s for a, b in itertools.pairwise(times))


def test_hysteresis_band_holds_near_target():
    r = Run(DECODE, 3)
    r.run(300, lambda n: signals(n, kv=0.7 * (1.08 if int(r.now) % 2 else 0.93)))
    assert r.changes == []


def test_oscillating_load_does_not_flap():
    # hot and cold alternate every 2 ticks: neither window ever sees one side only
    def load(n: int) -> RoleSignals:
        hot = int((r.now - 1000) / TICK) % 4 < 2
        return signals(n, kv=0.95 if hot else 0.05, itl=0.3 if hot else 0.01)

    r = Run(DECODE, 2)
    r.run(600, load)
    assert r.changes == []


def test_min_max_clamps():
    r = Run(DECODE, 2)
    r.run(120, lambda n: signals(n, kv=1.0, itl=5.0, running=40))
    assert r.replicas == DECODE.max_replicas
    assert max(n for _, n, _ in r.changes) == DECODE.max_replicas
    # a size outside the bounds (spec edit) is clamped at once, metrics or not
    d, _ = decide(DECODE, signals(0, missing=("a",)), 9, ScaleState(), 0.0)
    assert (d.replicas, d.direction) == (6, "down") and "clamped" in d.reason
    d, _ = decide(DECODE, signals(0, missing=()), 0, ScaleState(), 0.0)
    assert d.replicas == 1  # minReplicas 0 still keeps one pod (no signal without a pod)
    zero_min = ScalePolicy("decode", min_replicas=0, kv_usage=0.5, scale_down_window_s=0)
    d, _ = decide(zero_min, signals(1, kv=0.0), 1, ScaleState(), 0.0)
    assert d.replicas == 1


def test_missing_and_stale_metrics_hold_and_restart_the_windows():
    r = Run(DECODE, 2)
    r.run(8, lambda n: signals(n, kv=0.95))
    r.tick(signals(1, missing=("decode-b",), kv=0.95))
    assert r.last.direction == "hold" and "decode-b" in r.last.reason
    assert r.state.history == ()
    r.tick(signals(0, missing=()))
    assert "no Ready pod" in r.last.reason
    # back: the scale-up window starts over
    r.run(5, lambda n: signals(n, kv=0.95))
    assert r.replicas == 2
    r.run(10, lambda n: signals(n, kv=0.95))
    assert r.replicas == 3


def test_scale_from_zero_load():
    r = Run(PREFILL, 1)
    r.run(120, lambda n: signals(n, queue=0, running=0))  # idle: no latencies at all
    assert r.changes == [] and "fits" in r.last.reason
    r.run(15, lambda n: signals(n, queue=12 / n, ttft=0.5))
    assert r.replicas == 2  # queue 12 vs 4 per replica asks 3, capped at double
    r.run(30, lambda n: signals(n, queue=12 / n, ttft=0.5))
    assert r.replicas == 3


def test_role_signals_select_targets():
    # a prefill ignores KV usage; a decode ignores queue and TTFT
    d, _ = decide(PREFILL, signals(1, kv=1.0, queue=0, ttft=0.1), 1, ScaleState(), 0.0)
    assert d.direction == "hold"
    quick = ScalePolicy(
        "decode", kv_usage=0.5, queue_per_replica=1, ttft_s=0.1, scale_up_window_s=0
    )
    d, _ = decide(quick, signals(1, queue=50, ttft=9.0, kv=0.2, running=3), 1, ScaleState(), 0.0)
    assert d.direction == "hold"
    d, _ = decide(quick, signals(1, kv=0.9, running=3), 1, ScaleState(), 0.0)
    assert d.direction == "up"


def test_busy_role_without_latency_samples_is_no_evidence():
    policy = ScalePolicy("decode", itl_s=0.05, scale_down_window_s=0)
    d, _ = decide(policy, signals(2, running=3, itl=None), 2, ScaleState(), 0.0)
    assert d.direction == "hold" and "no signal" in d.reason


# --- signals from samples ------------------------------------------------------------

BOUNDS = (0.1, 0.5, 1.0, INF)


def sample(pod, t, *, queue=0.0, kv=0.0, ttft=(0, 0, 0, 0), cached=0.0) -> PodSample:
    return PodSample(pod, t, queue, 0.0, kv, cached, Buckets(BOUNDS, tuple(map(float, ttft))), None)


def test_histogram_quantile_interpolates_like_prometheus():
    b = Buckets(BOUNDS, (0.0, 10.0, 10.0, 10.0))
    assert histogram_quantile(0.9, b) == pytest.approx(0.1 + 0.4 * 0.9)
    assert histogram_quantile(0.9, Buckets(BOUNDS, (0, 0, 0, 5))) == 1.0  # +Inf bucket
    assert histogram_quantile(0.9, Buckets(BOUNDS, (0, 0, 0, 0))) is None


def test_windowed_p90_from_bucket_growth_and_counter_reset():
    windows = {
        # 100 fast requests long ago, then 10 slow ones inside the window
        "a": [
            sample("a", 0, ttft=(100, 100, 100, 100)),
            sample("a", 30, ttft=(100, 100, 110, 110)),
        ],
        # restarted: counts went down, the newest counts are the growth
        "b": [sample("b", 0, ttft=(50, 50, 50, 50)), sample("b", 30, ttft=(0, 0, 10, 10))],
    }
    sig = role_signals(["a", "b"], windows, now=31, stale_seconds=10)
    assert sig.reporting == 2 and sig.missing == ()
    assert 0.5 < sig.ttft_p90_s <= 1.0  # every windowed request was between 0.5 and 1 s


def test_stale_nan_and_unscraped_pods_are_missing():
    windows = {
        "fresh": [sample("fresh", 95, queue=3, kv=0.4, cached=0.2)],
        "stale": [sample("stale", 50, queue=9)],
        "nan": [sample("nan", 99, queue=math.nan)],
    }
    sig = role_signals(["fresh", "stale", "nan", "never"], windows, now=100, stale_seconds=15)
    assert sig.missing == ("stale", "nan", "never")
    assert (sig.reporting, sig.queue_per_replica, sig.kv_usage) == (1, 3, 0.4)
    assert sig.ttft_p90_s is None  # one sample is no window
    assert sig.cached_kv == {"fresh": 0.2}


def test_gauges_are_averaged_over_the_gauge_window():
    """A request counted on two pods in one scrape (each pod's gauge lags its scheduler)
    must not by itself ask for more replicas: each pod's gauges are its mean over the
    gauge window; older samples and invalid ones are left out of the mean."""
    windows = {
        "a": [sample("a", t, queue=q) for t, q in ((0, 8), (91, 0), (93, 0), (95, 0), (97, 2))],
        "b": [sample("b", 91, queue=0), sample("b", 96, queue=math.nan), sample("b", 97, queue=2)],
    }
    newest = role_signals(["a", "b"], windows, now=98, stale_seconds=15)
    assert newest.queue_per_replica == 2  # the one scrape that saw both
    averaged = role_signals(["a", "b"], windows, now=98, stale_seconds=15, gauge_window_s=10)
    assert averaged.queue_per_replica == pytest.approx((2 / 4 + 2 / 2) / 2)
    policy = ScalePolicy(
        "unified", queue_per_replica=1.0, scale_up_window_s=0, scale_down_window_s=0
    )
    assert decide(policy, newest, 2, ScaleState(), 98.0)[0].replicas == 4
    assert decide(policy, averaged, 2, ScaleState(), 98.0)[0].replicas == 2
