"""Scheduling: requests, the prefill adder's budgets, policies and the scheduler loop body."""

from kvflow.runtime.core import Req
from kvflow.runtime.scheduler.factory import ReqFactory
from kvflow.runtime.scheduler.port import SchedulerPort
from kvflow.runtime.scheduler.scheduler import Scheduler

__all__ = ["Req", "ReqFactory", "Scheduler", "SchedulerPort"]
