"""Scheduling: requests, the prefill adder's budgets, policies and the scheduler loop body."""

from kvflow.runtime.scheduler.output import TokenOutput
from kvflow.runtime.scheduler.req import FinishReason, Req
from kvflow.runtime.scheduler.scheduler import Scheduler

__all__ = ["FinishReason", "Req", "Scheduler", "TokenOutput"]
