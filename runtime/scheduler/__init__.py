"""Scheduling: requests, the prefill adder's budgets, policies and the scheduler loop body."""

from typing import TYPE_CHECKING

from kvflow.lazy import lazy_exports

if TYPE_CHECKING:
    from kvflow.runtime.core import Req
    from kvflow.runtime.scheduler.factory import ReqFactory
    from kvflow.runtime.scheduler.port import SchedulerPort
    from kvflow.runtime.scheduler.scheduler import Scheduler
else:  # torch-free until a name is used (kvflow.lazy)
    __getattr__ = lazy_exports(
        __name__,
        {
            "kvflow.runtime.core": ("Req",),
            ".factory": ("ReqFactory",),
            ".port": ("SchedulerPort",),
            ".scheduler": ("Scheduler",),
        },
    )

__all__ = ["Req", "ReqFactory", "Scheduler", "SchedulerPort"]
