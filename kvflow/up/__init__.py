"""``kvflow up``: a ModelDeployment file run as local processes, placed on 127.0.0.1."""

from .cli import main
from .plan import LocalPlan, LocalProcess, LocalRefusal, local_plan

__all__ = ["LocalPlan", "LocalProcess", "LocalRefusal", "local_plan", "main"]
