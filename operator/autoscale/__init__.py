"""Per-role autoscaling from runtime signals: samples -> signals -> decision -> scale.

Pure parts: :mod:`signals` (what a window of scrapes says about a role) and
:mod:`decision` (the rule). The collector scrapes pods; the loop applies decisions.
"""

from .decision import ROLE_SIGNALS, Decision, ScalePolicy, ScaleState, decide
from .signals import Buckets, PodSample, RoleSignals, histogram_quantile, role_signals

__all__ = [
    "ROLE_SIGNALS",
    "Buckets",
    "Decision",
    "PodSample",
    "RoleSignals",
    "ScalePolicy",
    "ScaleState",
    "decide",
    "histogram_quantile",
    "role_signals",
]
