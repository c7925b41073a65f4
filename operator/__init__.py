"""The kvflow operator: ModelDeployment spec -> Kubernetes objects -> status.

The public surface is pure (no cluster, no kopf, no torch): parse a ModelDeployment,
render its children, compute its status. The kopf side lives in ``kvflow.operator.main``
(``kvflow operator``), ``handlers``, ``reconcile`` and ``kube``.
"""

from .names import API_VERSION, FIELD_MANAGER, GROUP, KIND, PLURAL, VERSION
from .parse import parse_model_deployment
from .render import CHILD_KINDS, child_key, render_children
from .spec import ModelDeployment, SpecError, WorkerRole
from .status import Failure, Observation, ServiceReport, WorkloadReport, compute_status

__all__ = [
    "API_VERSION",
    "CHILD_KINDS",
    "FIELD_MANAGER",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "Failure",
    "ModelDeployment",
    "Observation",
    "ServiceReport",
    "SpecError",
    "WorkerRole",
    "WorkloadReport",
    "child_key",
    "compute_status",
    "parse_model_deployment",
    "render_children",
]
